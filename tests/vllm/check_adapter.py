"""Check ``vitserve.client.adapters.vllm_inputs`` against a real vLLM (CPU build).

vLLM fed vitserve's embeddings of two images (through ``vllm_inputs``) must generate the same
greedy tokens as vLLM fed the same images' pixels. The prompt logprobs of the two runs are
compared too (the logprob of every prompt and generated token, and the top-1 token at every
prompt position). A control run (each image's rows in reverse order) shows that the
embeddings reach the language model: a random model's generated tokens barely depend on the
images, its top-1 prompt predictions do.

Two parts, two virtual environments (vLLM's pins its own torch and transformers: see
``tests/vllm/make_env.sh``); ``tests/vllm/test_adapter.py`` runs both:

    # 1. the project's venv: encode two PNGs with vitserve's EncoderEngine
    .venv/bin/python tests/vllm/check_adapter.py --encode --model DIR --dtype fp32
    # 2. vLLM's venv: generate from pixels and from the embeddings, compare
    .venv-vllm/bin/python tests/vllm/check_adapter.py --vllm --model DIR --dtype fp32

``DIR`` is a model both serve (``vitserve.testing.models.cached_model("qwen2_vl", "tiny",
vllm=True)``). ``--dtype`` (fp32 or bf16) is both vitserve's encoder dtype and vLLM's model
dtype; bf16 embeddings are stored as raw uint16 words (vitserve's record convention) and
``vllm_inputs`` views them as ``torch.bfloat16``. Part 1 writes ``--out`` (the PNG bytes, the
embeddings and grids), which part 2 reads. Part 2 exits 1 if the generated ids or the prompt
top-1 ids differ, the largest prompt logprob difference exceeds ``--tol``, or the control
changes no top-1 prediction (the check would be vacuous).
"""

from __future__ import annotations

import argparse
import io
import os
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np

REPO = Path(__file__).resolve().parents[1]
SIZES = [(224, 224), (112, 168)]  # (width, height): multiples of 28, so no resizing
QUESTION = "Describe this image."


def encode(model: str, dtype: str, out: str) -> None:
    """Project venv: PNGs -> vitserve embeddings, saved with the PNGs and grids."""
    import torch
    from PIL import Image

    from vitserve.encoder.engine import EncoderEngine

    rng = np.random.default_rng(0)
    pngs = []
    for width, height in SIZES:
        buf = io.BytesIO()
        pixels = rng.integers(0, 256, (height, width, 3), dtype=np.uint8)
        Image.fromarray(pixels).save(buf, format="PNG")
        pngs.append(buf.getvalue())
    engine = EncoderEngine.from_pretrained(model, device="cpu", dtype=dtype)
    saved: dict[str, np.ndarray] = {"dtype": np.array(dtype)}
    for k, (png, emb) in enumerate(zip(pngs, engine.encode(pngs), strict=True)):
        tensor = emb.tensor.detach().cpu()
        words = tensor.view(torch.uint16) if tensor.dtype == torch.bfloat16 else tensor
        saved |= {
            f"png{k}": np.frombuffer(png, dtype=np.uint8),
            f"emb{k}": words.numpy(),
            f"grid{k}": np.array(emb.grid, dtype=np.int64),
        }
        print(f"image {k}: grid {emb.grid}, embedding {tuple(tensor.shape)} {tensor.dtype}")
    np.savez(out, **saved)
    print("wrote", out)


def run_vllm(model: str, dtype: str, path: str, max_tokens: int, tol: float) -> bool:
    """vLLM venv: generate from pixels, from ``vllm_inputs``, and a control; compare."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    # The engine in this process: what is checked is the numbers, not vLLM's process layout,
    # and a spawned engine core imports vLLM again (65 s -> 33 s on a 2-vCPU EPYC).
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    import torch
    import vllm
    from PIL import Image
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams

    from vitserve.client.adapters import vllm_inputs

    data = np.load(path)
    if str(data["dtype"]) != dtype:
        raise SystemExit(f"{path} holds {data['dtype']} embeddings; run --encode --dtype {dtype}")
    n = len(SIZES)
    images = [Image.open(io.BytesIO(data[f"png{k}"].tobytes())).convert("RGB") for k in range(n)]
    tag = "bf16" if dtype == "bf16" else "fp32"
    records = [
        SimpleNamespace(
            embedding=data[f"emb{k}"], extras={}, grid=tuple(data[f"grid{k}"]), dtype=tag
        )
        for k in range(n)
    ]
    mm_embeds = vllm_inputs(records)
    embeds = mm_embeds["image"]["image_embeds"]
    print(f"vllm {vllm.__version__}, torch {torch.__version__}, dtype {dtype}")
    print("vllm_inputs:", {k: (tuple(v.shape), v.dtype) for k, v in mm_embeds["image"].items()})
    # Control: each image's rows reversed (same shapes), must change the logprobs.
    sizes = [r.embedding.shape[0] for r in records]
    control = torch.cat([part.flip(0) for part in embeds.split(sizes)])
    mm_control = {"image": {**mm_embeds["image"], "image_embeds": control}}

    tokenizer = AutoTokenizer.from_pretrained(model)
    content = [{"type": "image"}] * n + [{"type": "text", "text": QUESTION}]
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True
    )
    llm = LLM(
        model=model,
        dtype={"fp32": "float32", "bf16": "bfloat16"}[dtype],
        max_model_len=1024,
        max_num_seqs=1,
        enforce_eager=True,
        enable_prefix_caching=False,
        enable_mm_embeds=True,
        limit_mm_per_prompt={"image": n, "video": 0},
    )
    params = SamplingParams(
        temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=1, prompt_logprobs=1
    )
    runs = {}
    for name, mm in [("pixels", {"image": images}), ("embeds", mm_embeds), ("control", mm_control)]:
        t0 = time.perf_counter()
        (out,) = llm.generate({"prompt": prompt, "multi_modal_data": mm}, params, use_tqdm=False)
        runs[name] = out
        print(f"{name:8s} {time.perf_counter() - t0:.2f} s: {list(out.outputs[0].token_ids)}")

    def logprobs(out) -> np.ndarray:
        ids = out.prompt_token_ids
        prompt_lp = [lp[i].logprob for i, lp in zip(ids[1:], out.prompt_logprobs[1:], strict=True)]
        gen = out.outputs[0]
        gen_lp = [lp[i].logprob for i, lp in zip(gen.token_ids, gen.logprobs, strict=True)]
        return np.array(prompt_lp + gen_lp)

    def top1(out) -> np.ndarray:  # greedy next-token prediction at every prompt position
        return np.array(
            [next(t for t, lp in d.items() if lp.rank == 1) for d in out.prompt_logprobs[1:]]
        )

    pixels, embeds_out, ctrl = runs["pixels"], runs["embeds"], runs["control"]
    print(
        "prompt tokens:",
        len(pixels.prompt_token_ids),
        "same ids:",
        pixels.prompt_token_ids == embeds_out.prompt_token_ids,
    )
    same = list(pixels.outputs[0].token_ids) == list(embeds_out.outputs[0].token_ids)
    ref = logprobs(pixels)
    print(f"token ids identical: {same}")
    gaps = {}
    for name, out in [("embeds", embeds_out), ("control", ctrl)]:
        gaps[name] = diff = float(np.abs(ref - logprobs(out)).max())
        moved = int((top1(pixels) != top1(out)).sum())
        print(
            f"pixels vs {name:7s}: max |logprob diff| {diff:.3g}, "
            f"prompt positions whose top-1 token differs: {moved}"
        )
    control_moved = bool((top1(pixels) != top1(ctrl)).any())
    print(f"control changed the top-1 predictions: {control_moved}")
    return (
        same
        and not (top1(pixels) != top1(embeds_out)).any()
        and gaps["embeds"] <= tol
        and control_moved
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    part = parser.add_mutually_exclusive_group(required=True)
    part.add_argument("--encode", action="store_true", help="part 1, in the project venv")
    part.add_argument("--vllm", action="store_true", help="part 2, in vLLM's venv")
    parser.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    parser.add_argument("--model", required=True, help="a model folder vitserve and vLLM serve")
    parser.add_argument("--out", help="embeddings file (default /tmp/vllm-adapter-<dtype>.npz)")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--tol", type=float, default=1e-4, help="prompt logprob tolerance")
    args = parser.parse_args()
    path = args.out or f"/tmp/vllm-adapter-{args.dtype}.npz"
    if args.encode:
        encode(args.model, args.dtype, path)
    elif not run_vllm(args.model, args.dtype, path, args.max_tokens, args.tol):
        sys.exit(1)


if __name__ == "__main__":
    main()
