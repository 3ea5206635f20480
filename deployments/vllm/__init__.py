"""The vLLM front: OpenAI chat completions encoded hash first, forwarded to vLLM servers.

Lives here: the Serve deployment and its builder (``app``, ``import_path``
``vitserve.deployments.vllm.app:build_app``).

May import: ``vitserve.deployments.common``, ``vitserve.client``, ``vitserve.errors``. Never
torch, and never the encoder, prefill or runner rooms.
"""
