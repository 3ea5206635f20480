"""vitserve.client: the SDK an LLM server imports (httpx, numpy, msgpack; torch only lazily)."""
