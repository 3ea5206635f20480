"""Decoding with the end tokens held back (``Sampling.min_tokens``), on each family's tiny model.

The generator runs as the prefill replicas run it (the language model loaded without its vision
tower, a text-only prompt prefilled through a real ``EncoderClient``: a prompt without images
reads no row, so the client never reaches its URL). Its end tokens are the checkpoint's plus the
token the model ranks first after the prompt, so a plain decode stops at once, as the demo model
does; the reference is the full transformers model's ``generate`` with ``min_new_tokens`` and
the same end tokens.
"""

from __future__ import annotations

from typing import Any

import pytest

from vitserve.testing.models import FAMILIES

HELD = 5  # min_tokens
MORE = 3  # max_tokens - min_tokens
PROMPT = "Describe the picture in a few words, please."


def _prompt_ids(path: Any) -> list[int]:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)(PROMPT, add_special_tokens=False)["input_ids"]


@pytest.fixture(scope="module")
def generators(tiny_models) -> dict[str, Any]:
    """family -> (the generator, its loaded language model, the prompt's ids)."""
    from vitserve.deployments.prefill.generation import Generator
    from vitserve.encoder.language_model import load_language_model

    out = {}
    for family in FAMILIES:
        loaded = load_language_model(str(tiny_models[family]), device="cpu", dtype="fp32")
        eos = loaded.model.generation_config.eos_token_id
        out[family] = (Generator(loaded.model, chunk_size=8, eos_ids=eos), loaded)
    return out


def _prefill(generator: Any, loaded: Any, ids: list[int]) -> Any:
    """A fresh prefill of ``ids`` (decoding extends its cache in place)."""
    from vitserve.client import EncoderClient
    from vitserve.client.adapters import prompt_layout

    layout = prompt_layout(loaded.config, ids, [])
    with EncoderClient("http://127.0.0.1:9") as client:  # never reached: no image rows
        return generator.prefill(client, layout, [])


def _with_first_token_as_end(family: str, generators: dict[str, Any], tiny_models) -> Any:
    """The family's generator with its first greedy token added to the end tokens, the
    loaded model, the prompt's ids and that token."""
    from vitserve.deployments.prefill.generation import Generator

    generator, loaded = generators[family]
    ids = _prompt_ids(tiny_models[family])
    first = int(_prefill(generator, loaded, ids).last_logits.argmax())
    eos = sorted(generator.eos_ids | {first})
    return Generator(loaded.model, chunk_size=8, eos_ids=eos), loaded, ids, first


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_with_the_end_tokens_held_back_equals_transformers_min_new_tokens(
    family, generators, tiny_models
) -> None:
    import torch

    from vitserve.deployments.prefill.generation import Sampling
    from vitserve.testing.models import full_model_class

    generator, loaded, ids, first = _with_first_token_as_end(family, generators, tiny_models)
    plain = Sampling(max_tokens=HELD + MORE, temperature=0.0)
    assert list(generator.decode(_prefill(generator, loaded, ids), plain)) == []

    held = Sampling(max_tokens=HELD + MORE, temperature=0.0, top_logprobs=3, min_tokens=HELD)
    steps = list(generator.decode(_prefill(generator, loaded, ids), held))
    tokens = [s.token for s in steps]
    assert HELD <= len(tokens) <= HELD + MORE
    assert not set(tokens[:HELD]) & generator.eos_ids
    # the reported logprobs are the model's own: the held-back token is still its first choice
    assert steps[0].top[0][0] == first and steps[0].top[0][1] > steps[0].logprob

    full = full_model_class(family).from_pretrained(
        tiny_models[family], attn_implementation="sdpa", dtype=torch.float32
    )
    prompt = torch.tensor([ids])
    with torch.no_grad():
        out = full.eval().generate(
            input_ids=prompt,
            attention_mask=torch.ones_like(prompt),
            max_new_tokens=HELD + MORE,
            min_new_tokens=HELD,
            do_sample=False,
            eos_token_id=sorted(generator.eos_ids),
            pad_token_id=0,
        )
    want = out[0, len(ids) :].tolist()
    if want[-1] in generator.eos_ids:
        want = want[:-1]  # generate returns the end token, the generator does not
    print(f"{family}: end tokens {sorted(generator.eos_ids)}, held for {HELD}: {tokens}")
    assert tokens == want


def test_sampling_never_draws_a_held_back_end_token(generators, tiny_models) -> None:
    """At a temperature this low the draw is all but surely the first greedy token (an end
    token here); for ``min_tokens`` steps it is out of the draw, whatever the seed."""
    from vitserve.deployments.prefill.generation import Sampling

    generator, loaded, ids, _ = _with_first_token_as_end("llava", generators, tiny_models)
    for seed in range(4):
        sampling = Sampling(max_tokens=HELD, temperature=1e-3, top_p=0.9, seed=seed)
        assert list(generator.decode(_prefill(generator, loaded, ids), sampling)) == []
        held = Sampling(max_tokens=HELD, temperature=1e-3, top_p=0.9, seed=seed, min_tokens=HELD)
        tokens = [s.token for s in generator.decode(_prefill(generator, loaded, ids), held)]
        assert len(tokens) == HELD and not set(tokens) & generator.eos_ids, (seed, tokens)
