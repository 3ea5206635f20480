"""The reference prefill application: OpenAI chat completions over the model's language model.

Lives here: the Serve deployment and its builder (``app``, ``import_path``
``vitserve.deployments.prefill.app:build_app``), the chat request model and prompt building
(``chat``), the chat service that pulls each prefill chunk's rows through the client SDK
(``chat_service``), and decoding (``generation``).

May import: ``vitserve.deployments.common``, ``vitserve.client`` (it reaches the encoder
application only through the SDK), ``vitserve.encoder`` (the language model),
``vitserve.errors``. Never the encoder, vLLM or runner rooms.
"""
