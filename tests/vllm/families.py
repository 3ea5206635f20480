"""The test-model families vLLM 0.32's CPU build serves, and the image sizes their tests use.

Found by running vLLM's offline ``LLM`` (``dtype="float32"``, ``enforce_eager=True``,
``enable_mm_embeds=True``) on ``make_model(family, "tiny", out, vllm=True)`` folders with a
two-image chat-templated prompt and the sizes below: for every family the output of the model's
``embed_multimodal`` for each image equaled vitserve's record of it laid out as
``vitserve.client.vllm.cache_tensor`` lays it (fp32, within ~1e-6 relative): the embedding as
it is (Qwen2-VL, Qwen2.5-VL; LLaVA: the post-projector rows without CLS; Gemma 3: the pooled,
projected rows), and for Qwen3-VL the embedding and its deepstack levels side by side
(``[rows, hidden * (1 + levels)]``). Sizes are ``(width, height)`` and need no resize in either
preprocessing (multiples of the patch grid for Qwen, a crop only for LLaVA, the tower's square
for Gemma 3); whether vitserve's PIL resize and vLLM's processor agree on other sizes was not
measured.

Gemma 4 (added later, checked through ``test_families.py``) serves in fp32 with the audio
placeholder and its open/close tokens in the tokenizer (vLLM's Gemma 4 processor refuses a
tokenizer without them) and ``vision_config.default_output_length`` in the config (vLLM sizes its
prompts by it). Qwen3.5 (added later, checked only through ``test_families.py``) serves in bf16
alone: vLLM's CPU gated-DeltaNet kernels refuse fp32 ("CPU GDN attention requires BF16.") and
head sizes other than the published 128 ("Unexpected head dim size, 32"; the test model's
linear-attention heads are 128 wide for this).

Families not in ``VLLM_FAMILIES``: VipLLaVA, whose spec refuses vLLM embedding inputs (not
checked against a vLLM build; ``vitserve/families/vipllava.py``). The other six serve with
``vllm=True``. Without ``vllm=True`` (the default test models) every family fails in vLLM 0.32
CPU:

* all: ``ValueError: Unsupported CPU attention configuration: head_dim=16`` (the text heads);
* LLaVA (transformers 5 saves the tower as ``vision_tower.*``): ``ValueError: There is no
  module or parameter named 'vision_tower.embeddings' in LlavaForConditionalGeneration``
  (Gemma 3's tower is saved alike and renamed alike; not run without the rename);
* Gemma 3 (byte-level BPE has no ``"\\n"`` token): ``KeyError: '\\n'`` in
  ``gemma3_mm.py::_apply_token_matches`` (``vocab["\\n"]``), while profiling;
* Gemma 3 without a ``processor_config.json`` (``image_seq_length`` defaults to 256): at the
  first request, ``ValueError: Attempted to assign 64 + 64 = 128 multimodal tokens to 512
  placeholders``.
"""

from __future__ import annotations

# family -> two image sizes of the equality tests
SIZES: dict[str, tuple[tuple[int, int], ...]] = {
    "qwen2_vl": ((224, 224), (112, 168)),  # multiples of 28 (patch 14, merge 2)
    "qwen2_5_vl": ((224, 224), (112, 168)),
    "qwen3_vl": ((224, 224), (128, 192)),  # multiples of 32 (patch 16, merge 2)
    "qwen3_5": ((224, 224), (128, 192)),  # Qwen3-VL's tower and processor
    "llava": ((224, 224), (336, 224)),  # shortest edge 224 already: a center crop only
    "gemma3": ((224, 224), (224, 224)),  # every other size is resized to 224x224
    # already the largest sides in multiples of 48 px within 630 patches (70 soft tokens):
    # 64 and 60 rows; vLLM's count of soft tokens (its own formula) agrees at these sizes
    "gemma4": ((384, 384), (480, 288)),
}
VLLM_FAMILIES = tuple(SIZES)


if __name__ == "__main__":  # each family's tiny vLLM test model folder, built if missing
    from vitserve.testing.models import cached_model

    for family in VLLM_FAMILIES:
        print(cached_model(family, "tiny", vllm=True))
