"""The store record of an LLM server's encoder output (``columns_record``: what a vLLM
connector in role ``ec_both`` publishes), read back through the codec bit for bit."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from vitserve.cache.codec import decode_record, encode_record
from vitserve.client.ec_plan import split_columns
from vitserve.deployments.encoder.records import columns_record

KEY = "ab" * 32


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_an_encoder_cache_tensor_splits_into_its_named_groups(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    width = 8
    tensor = torch.randn(5, 4 * width).to(dtype)  # Qwen3-VL: the embedding and 3 levels
    names = split_columns(tensor.shape[1], width)
    assert names == ["embedding", "deepstack_0", "deepstack_1", "deepstack_2"]
    record = columns_record(KEY, "fp", tensor, names, grid=(1, 4, 6))
    back = decode_record(encode_record(record), key=KEY, fingerprint="fp")
    assert (back.num_tokens, back.grid) == (5, (1, 4, 6))
    for i, name in enumerate(names):
        want = tensor[:, i * width : (i + 1) * width]
        got = torch.from_numpy(np.array(back.tensors[name]))
        if dtype == torch.bfloat16:
            got = got.view(torch.bfloat16)
        assert torch.equal(got, want), name


def test_a_tensor_that_does_not_split_is_refused() -> None:
    assert split_columns(30, 8) is None and split_columns(8, 0) is None
    assert split_columns(8, 8) == ["embedding"]
    with pytest.raises(ValueError):
        columns_record(KEY, "fp", torch.zeros(2, 31), ["embedding", "deepstack_0"])
    with pytest.raises(ValueError):
        columns_record(KEY, "fp", torch.zeros(2, 30), [])
