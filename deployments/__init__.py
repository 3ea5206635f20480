"""vitserve.deployments: the Ray Serve applications, what they share, and the runner.

Rooms (each package's docstring states what lives there and what it may import; ``tests/
test_layering.py`` enforces the rules):

- ``common/``: what every HTTP application uses (strict config, auth, metrics, error answers,
  request-body reading, graceful stop). Imports no other room.
- ``encoder/``: the encoder application (HTTP ingress, preprocess and encoder replicas, the
  device queue, admission, single flight, autoscaling). Imports ``common`` only.
- ``prefill/``: the reference prefill application (OpenAI chat over the model's language model,
  fed by the encoder application through the client SDK). Imports ``common`` only.
- ``vllm/``: the OpenAI front that encodes hash first and forwards to vLLM servers. Imports
  ``common`` only.
- ``runner/``: the ``vitserve`` CLI, the local (embedded) cluster and the demo. May import every
  room; no room imports it.
"""
