"""Publishing an embedding the encoder computed on CUDA (marked ``gpu``: skipped without a GPU,
see tests/gpu.py).

The encoder replica turns each engine ``Embedding`` (tensors on the device) into a store record
with ``embedding_record`` (``deployments/encoder/records.py``, which imports no Ray) and the
codec's ``encode_record``, as its publish path does; nothing else of the replica is needed, so
the test runs on a GPU machine without Ray, and an in-process memory store stands in for the
replica's. The record read back from a store holds the device's
values bit for bit (bf16 as its raw words, fp16 and fp32 as they are), with the header's dtype,
token count and grid, and the SDK's ``device="cuda"`` path turns it back into a tensor equal to
the one the encoder produced.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from vitserve.cache.urls import open_store
from vitserve.testing.images import make_image

pytestmark = pytest.mark.gpu

# (family, dtype): Qwen3-VL's deepstack extras in bf16 (the GPU default), the others in the
# dtypes an older GPU (fp16) or a precise run (fp32) publishes.
CASES = [("qwen3_vl", "bf16"), ("gemma3", "fp16"), ("llava", "fp32")]
IMAGES = [make_image(320, 240, seed=31), make_image(96, 160, seed=32)]


@pytest.fixture
def store() -> Iterator[Any]:
    store = open_store("memory://", namespace="")  # any fingerprint: the engine's is checked
    yield store
    store.close()


@pytest.mark.parametrize(("family", "dtype"), CASES)
def test_a_cuda_embedding_is_published_bit_for_bit(
    tiny_models, batching_limits, store, family: str, dtype: str
) -> None:
    import torch

    from vitserve.cache.codec import encode_record
    from vitserve.client.device import as_tensor
    from vitserve.deployments.encoder.records import embedding_record
    from vitserve.encoder.device import dtype_name
    from vitserve.encoder.engine import EncoderEngine

    engine = EncoderEngine.from_pretrained(
        str(tiny_models[family]), device="cuda", dtype=dtype, **batching_limits
    )
    embeddings = engine.encode(IMAGES)
    store.put_values(
        [(e.key, encode_record(embedding_record(e, engine.fingerprint))) for e in embeddings]
    )
    for e in embeddings:
        assert e.tensor.is_cuda
        record = store.get(e.key)
        assert record is not None, "the published value did not read back"
        assert (record.dtype, record.fingerprint) == (dtype_name(engine.dtype), engine.fingerprint)
        assert (record.num_tokens, record.grid) == (e.num_tokens, e.grid)
        assert set(record.tensors) == {"embedding", *e.extras}
        for name, tensor in [("embedding", e.tensor), *e.extras.items()]:
            host = as_tensor(record.tensors[name], record.dtype)  # CPU view of the stored words
            assert torch.equal(host, tensor.cpu()), name
            back = as_tensor(record.tensors[name], record.dtype, device=tensor.device)
            torch.cuda.synchronize()
            assert back.device == tensor.device and torch.equal(back, tensor), name
