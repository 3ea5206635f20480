"""The full (monolithic) transformers model, run the way the tests check vitserve against it:
a prompt's token ids with each image's placeholders, the forward's inputs with the family's
extras, and greedy decoding after a prefill. Only the tests use these; the test models
themselves are :mod:`vitserve.testing.models`."""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

from vitserve.families import family_spec
from vitserve.families.spec import ImageAttention, Positions


def image_prompt(config: Any, counts: list[int]) -> list[int]:
    """A test prompt's token ids: BOS, text, then per image its placeholders as the family's
    processor expands them (its spec's open token, ``counts[k]`` image tokens for image ``k``,
    its close token: Qwen vision_start/end, Gemma 3 boi/eoi, LLaVA none), then text."""
    placeholders = family_spec(str(config.model_type)).placeholders
    open_ = [getattr(config, placeholders.open)] if placeholders.open else []
    close = [getattr(config, placeholders.close)] if placeholders.close else []
    ids = [1, 11, 12, 13]
    for k, n in enumerate(counts):
        ids += [*open_, *[config.image_token_id] * n, *close, 20 + k, 21 + k, 22]
    return [*ids, 30, 31]


def pixel_inputs(config: Any, ids: list[int], pixels: Mapping[str, Any]) -> dict[str, Any]:
    """The full model's forward arguments for prompt ``ids`` and the image processor's output
    ``pixels``: the family's extras (Qwen's grids and ``mm_token_type_ids``, Gemma 3's
    ``token_type_ids``, Gemma 4's patch positions) included."""
    # heavy: tests/client/test_adapters.py imports this module, torch only where it runs
    import torch

    spec = family_spec(str(config.model_type))
    input_ids = torch.tensor([ids])
    kwargs = {
        "input_ids": input_ids,
        "attention_mask": torch.ones_like(input_ids),
        "pixel_values": pixels["pixel_values"],
    }
    if "image_position_ids" in pixels:  # Gemma 4's patch positions (-1: padding)
        kwargs["image_position_ids"] = pixels["image_position_ids"]
    image_types = (input_ids == config.image_token_id).long()
    if spec.positions is Positions.MROPE:
        kwargs |= {"image_grid_thw": pixels["image_grid_thw"], "mm_token_type_ids": image_types}
    if spec.image_attention is ImageAttention.BIDIRECTIONAL:
        kwargs["token_type_ids"] = image_types
    return kwargs


def greedy_after_prefill(
    model: Any,
    prefill: Any,
    attention_mask: Any,
    position_ids: Any,
    steps: int,
    eos: Collection[int] = (),
) -> list[int]:
    """Greedy tokens continuing a prefill's output (``.logits``, ``.past_key_values``), one
    token a step through the full model: at most ``steps``, stopping after a token in ``eos``.
    Qwen's M-RoPE positions (``position_ids`` given) continue at ``position_ids.max() + 1`` in
    all three rows."""
    # heavy: tests/client/test_adapters.py imports this module, torch only where it runs
    import torch

    start = int(position_ids.max()) + 1 if position_ids is not None else attention_mask.shape[1]
    out, mask, tokens = prefill, attention_mask, []
    for step in range(steps):
        tokens.append(int(out.logits[0, -1].argmax()))
        if tokens[-1] in eos or step == steps - 1:
            break
        mask = torch.cat([mask, mask.new_ones(1, 1)], dim=1)
        kwargs = {
            "input_ids": torch.tensor([[tokens[-1]]]),
            "attention_mask": mask,
            "past_key_values": out.past_key_values,
            "use_cache": True,
        }
        if position_ids is not None:
            kwargs["position_ids"] = torch.full((3, 1, 1), start + step)
        out = model(**kwargs)
    return tokens
