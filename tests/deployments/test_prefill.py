"""The prefill application against the monolithic transformers model, for every family.

For each family (``vitserve.families``) a vitserve encoder application and a prefill
application run the family's tiny model (fp32). A chat request with two images of different
sizes goes through the prefill route; the reference is the full ``*ForConditionalGeneration``
model run on the same prompt and the pixels: the LLaVA-style families' (LLaVA, VipLLaVA) and
Gemma 3's prompts come from their transformers processors (``LlavaProcessor``,
``Gemma3Processor``; Qwen's processor needs torchvision, which this machine cannot import, so
its placeholders are expanded here as ``Qwen2VLProcessor`` does: ``<|image_pad|>`` repeated
grid / merge**2 times).

* Logits: ``ChatService.prepare(keep_logits=True)`` (the code the replicas run, in this process,
  against the same encoder application) gives every prompt position's logits from the chunked
  prefill; compared with the full model's forward on the pixels. Tolerance ``LOGIT_ATOL``
  (1e-4): the chunked forward multiplies other matrix shapes than the one-shot one, so fp32
  sums may differ in order (measured ~2e-7 on logits of magnitude ~1); a wrong position, a row
  in the wrong place or a split Gemma 3 image moves them by 3e-3 to 0.7.
* Greedy tokens and logprobs over HTTP: ``temperature: 0`` gives the full model's
  ``generate(do_sample=False)`` tokens; each token's logprob and top-5 equal the model's
  ``log_softmax`` within ``LOGIT_ATOL``.
* The chunk size (16) puts chunk edges inside the images' placeholder runs (Qwen, LLaVA), and
  for Gemma 3 the chunker keeps each image whole (a chunk longer than 16 tokens).
* With the end tokens held back (``min_tokens``) the same holds against the full model's
  ``generate(min_new_tokens=...)``, the tokens compared as ids (``return_token_ids``).
"""

from __future__ import annotations

import base64
import concurrent.futures as cf
import io
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from vitserve.client.adapters import FAMILIES
from vitserve.client.chunks import chunk_bounds
from vitserve.deployments.prefill.chat import PIECE_CHARS
from vitserve.families import SPECS
from vitserve.families.spec import Marker, Positions, Tower
from vitserve.testing.images import make_image
from vitserve.testing.models import IMAGE_TOKEN_ID

SIZES = ((140, 84), (56, 112))  # (width, height): two images whose Qwen grids differ
NEW_TOKENS = 6
LOGIT_ATOL = 1e-4
CHUNK = 16
TOP = 5


def _images() -> list[bytes]:
    return [make_image(w, h, seed=k + 1) for k, (w, h) in enumerate(SIZES)]


def data_url(image: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(image).decode()


def _messages(images: list[bytes]) -> list[dict[str, Any]]:
    a, b = (data_url(i) for i in images)
    return [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "Compare the first picture"},
                {"type": "image_url", "image_url": {"url": a}},
                {"type": "text", "text": "with the second one"},
                {"type": "image_url", "image_url": {"url": b}},
                {"type": "text", "text": "and describe them."},
            ],
        }
    ]


def chat_body(images: list[bytes], **extra: Any) -> dict[str, Any]:
    return {"messages": _messages(images), "temperature": 0, "max_tokens": NEW_TOKENS, **extra}


@pytest.fixture(scope="module")
def pairs(family_apps, deploy_prefill) -> dict[str, Any]:
    """family -> its prefill application (over the session's encoder application of that
    family), started at once."""

    def start(family: str) -> Any:
        return deploy_prefill(f"pf-{family}", family_apps[family], **{"prefill.num_cpus": 0.05})

    with cf.ThreadPoolExecutor(len(FAMILIES)) as pool:
        apps = dict(zip(FAMILIES, pool.map(start, FAMILIES), strict=True))
    return apps  # removed with the module, all at once


# -- the reference: the monolithic model on the pixels ------------------------------------------
def _full_model(path: Path, family: str) -> Any:
    import torch

    from vitserve.testing.models import full_model_class

    return (
        full_model_class(family)
        .from_pretrained(path, attn_implementation="sdpa", dtype=torch.float32)
        .eval()
    )


def reference_inputs(path: Path, family: str, config: Any) -> dict[str, Any]:
    """The full model's inputs for ``_messages``: token ids from the family's processor (Qwen:
    expanded here, see the module docstring) and the pixels."""
    import transformers as tf
    from PIL import Image
    from transformers import AutoImageProcessor, AutoTokenizer

    from vitserve.deployments.prefill.chat import ChatRequest, template_messages

    tokenizer = AutoTokenizer.from_pretrained(path)
    image_processor = AutoImageProcessor.from_pretrained(path)
    pil = [Image.open(io.BytesIO(b)).convert("RGB") for b in _images()]
    messages = template_messages(ChatRequest.parse({"messages": _messages(_images())}))
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    spec = SPECS[family]
    if spec.positions is Positions.MROPE:
        pixels = dict(image_processor(images=pil, return_tensors="pt"))
        merge = config.vision_config.spatial_merge_size
        pad = "<|image_pad|>"
        parts = text.split(pad)
        counts = [int(g.prod()) // merge**2 for g in pixels["image_grid_thw"]]
        text = parts[0] + "".join(pad * n + p for n, p in zip(counts, parts[1:], strict=True))
        ids = tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
        image_types = (ids == IMAGE_TOKEN_ID).long()
        return {
            "input_ids": ids,
            "attention_mask": ids.new_ones(ids.shape),
            "pixel_values": pixels["pixel_values"],
            "mm_token_type_ids": image_types,
            "image_grid_thw": pixels["image_grid_thw"],
        }
    if spec.placeholders.marker is Marker.WRAPPED_IMAGE:
        # Gemma 4: its processor's expansion spelled out (Gemma4Processor needs a video
        # processor, which needs torchvision): <|image|> -> <|image>, n soft tokens, <image|>.
        pixels = dict(image_processor(images=pil, return_tensors="pt"))
        counts = [int(n) for n in pixels.pop("num_soft_tokens_per_image")]
        image, boi, eoi = tokenizer.image_token, tokenizer.boi_token, tokenizer.eoi_token
        parts = text.split(image)
        text = parts[0] + "".join(
            f"{boi}{image * n}{eoi}{p}" for n, p in zip(counts, parts[1:], strict=True)
        )
        ids = tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
        return {"input_ids": ids, "attention_mask": ids.new_ones(ids.shape), **pixels}
    if spec.vision.tower is Tower.FIXED_SIZE:  # LLaVA-style: the LLaVA processor
        processor = tf.LlavaProcessor(
            image_processor=image_processor,
            tokenizer=tokenizer,
            patch_size=config.vision_config.patch_size,
            vision_feature_select_strategy="default",
            num_additional_image_tokens=1,
        )
    else:
        processor = tf.Gemma3Processor(
            image_processor=image_processor,
            tokenizer=tokenizer,
            image_seq_length=config.mm_tokens_per_image,
        )
    out = dict(processor(text=[text], images=pil, return_tensors="pt", add_special_tokens=False))
    out.pop("mm_token_type_ids", None)
    return out


@pytest.fixture(scope="module")
def full_models(tiny_models) -> dict[str, Any]:
    """family -> the monolithic model, loaded once for the module's references."""
    return {family: _full_model(tiny_models[family], family) for family in FAMILIES}


@pytest.fixture(scope="module")
def references(tiny_models, full_models) -> dict[str, Any]:
    """family -> (prompt ids, prompt logits, greedy tokens, per-token logits) of the full
    model on the pixels."""
    import torch

    out = {}
    for family in FAMILIES:
        model = full_models[family]
        inputs = reference_inputs(tiny_models[family], family, model.config)
        with torch.no_grad():
            logits = model(**inputs).logits[0]
            gen = model.generate(
                **inputs,
                max_new_tokens=NEW_TOKENS,
                do_sample=False,
                output_logits=True,
                return_dict_in_generate=True,
            )
        length = inputs["input_ids"].shape[1]
        tokens = gen.sequences[0, length:].tolist()
        out[family] = (inputs["input_ids"][0].tolist(), logits, tokens, [s[0] for s in gen.logits])
    return out


@pytest.fixture(scope="module")
def held_references(tiny_models, full_models) -> dict[str, Any]:
    """family -> (greedy tokens, per-token logits) of the full model on the pixels, its end
    tokens held back for the first ``NEW_TOKENS`` (``min_new_tokens``); end token excluded."""
    import torch

    out = {}
    for family in FAMILIES:
        model = full_models[family]
        inputs = reference_inputs(tiny_models[family], family, model.config)
        with torch.no_grad():
            gen = model.generate(
                **inputs,
                max_new_tokens=NEW_TOKENS + 2,
                min_new_tokens=NEW_TOKENS,
                do_sample=False,
                output_logits=True,
                return_dict_in_generate=True,
            )
        tokens = gen.sequences[0, inputs["input_ids"].shape[1] :].tolist()
        if tokens[-1] in model.generation_config.eos_token_id:
            tokens.pop()
        out[family] = (tokens, [s[0] for s in gen.logits])
    return out


# -- equivalence ----------------------------------------------------------------------------------
@pytest.mark.parametrize("family", FAMILIES)
def test_chunked_prefill_logits_equal_the_monolithic_model(
    family, pairs, references, tiny_models
) -> None:
    """Every prompt position's logits, chunk by chunk through the SDK, against the full model
    on the pixels; the chunks split the images (Gemma 3: keep them whole)."""
    from vitserve.client import EncoderClient
    from vitserve.deployments.prefill.chat_service import ChatService

    app = pairs[family]
    want_ids, want_logits, _, _ = references[family]
    with EncoderClient(app.encoder.url) as client:
        service = ChatService(app.config, client)
        prepared = service.prepare(chat_body(_images()), keep_logits=True)
    layout = prepared.prefilled.layout
    assert layout.input_ids.tolist() == want_ids
    got = prepared.prefilled.all_logits
    diff = (got - want_logits).abs().max().item()
    print(
        f"{family}: prompt of {layout.length} tokens in {len(prepared.prefilled.chunks)} "
        f"chunks, max |logit diff| {diff:.3g} (logits up to {want_logits.abs().max():.3g})"
    )
    assert diff <= LOGIT_ATOL

    bounds = [(c.start, c.end) for c in prepared.prefilled.chunks]
    inside = [(s, sp) for s, _ in bounds[1:] for sp in layout.spans if sp.offset < s < sp.end]
    if family == "gemma3":
        assert not inside  # no edge inside an image ...
        assert any(e - s > CHUNK for s, e in bounds)  # ... so a chunk holds a whole one
        assert chunk_bounds(layout.length, CHUNK) != bounds  # plain 16s would split one
    else:
        assert inside, "the chunk size should split an image across chunks"
    assert prepared.usage["rows_pulled"] == sum(s.num_tokens for s in layout.spans)


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_tokens_and_logprobs_over_http_equal_the_monolithic_model(
    family, pairs, references
) -> None:
    import torch

    app = pairs[family]
    _, _, want_tokens, step_logits = references[family]
    response = app.chat(chat_body(_images(), logprobs=True, top_logprobs=TOP))
    assert response.status_code == 200, response.text
    answer = response.json()
    content = answer["choices"][0]["logprobs"]["content"]
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(app.config.model)
    assert [c["token"] for c in content] == tokenizer.convert_ids_to_tokens(want_tokens)
    worst = 0.0
    for entry, logits in zip(content, step_logits, strict=False):
        want = torch.log_softmax(logits.float(), -1)
        top_values, top_ids = want.topk(TOP)
        got_top = entry["top_logprobs"]
        assert [t["token"] for t in got_top] == tokenizer.convert_ids_to_tokens(top_ids.tolist())
        diffs = [abs(t["logprob"] - float(v)) for t, v in zip(got_top, top_values, strict=True)]
        worst = max(worst, *diffs)
    print(f"{family}: tokens {want_tokens}, max |logprob diff| {worst:.3g}")
    assert worst <= LOGIT_ATOL
    usage = answer["usage"]
    assert usage["completion_tokens"] == len(want_tokens)
    assert usage["images_sent"] == 2
    assert answer["choices"][0]["finish_reason"] in ("stop", "length")
    text = tokenizer.decode(want_tokens, skip_special_tokens=True)
    assert answer["choices"][0]["message"]["content"] == text


@pytest.mark.parametrize("family", FAMILIES)
def test_held_back_end_tokens_over_http_equal_the_monolithic_models_min_new_tokens(
    family, pairs, references, held_references
) -> None:
    """``min_tokens``: at least that many tokens, none of them an end token, and the very
    tokens (by id) and logprobs of the full model's ``generate(min_new_tokens=...)``."""
    import torch

    app = pairs[family]
    want_tokens, step_logits = held_references[family]
    held = {"max_tokens": NEW_TOKENS + 2, "min_tokens": NEW_TOKENS, "return_token_ids": True}
    body = chat_body(_images(), logprobs=True, skip_special_tokens=False, **held)
    response = app.chat(body)
    assert response.status_code == 200, response.text
    answer = response.json()
    choice = answer["choices"][0]
    plain = references[family][2]
    print(f"{family}: greedy {plain}, end tokens held for {NEW_TOKENS}: {choice['token_ids']}")
    assert choice["token_ids"] == want_tokens and len(want_tokens) >= NEW_TOKENS
    assert answer["prompt_token_ids"] == references[family][0]
    assert answer["usage"]["completion_tokens"] == len(want_tokens)
    got = [c["logprob"] for c in choice["logprobs"]["content"]]
    # generate's logits run one step past the last token when it stopped at an end token
    steps = zip(want_tokens, step_logits, strict=False)
    want = [float(torch.log_softmax(logits.float(), -1)[t]) for t, logits in steps]
    assert max(abs(a - b) for a, b in zip(got, want, strict=True)) <= LOGIT_ATOL
    finish = "length" if len(want_tokens) == NEW_TOKENS + 2 else "stop"
    assert choice["finish_reason"] == finish
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(app.config.model)
    text = tokenizer.decode(want_tokens, skip_special_tokens=False)  # asked for: specials kept
    assert choice["message"]["content"] == text


def test_streaming_gives_the_same_tokens_as_one_answer(pairs) -> None:
    import json

    app = pairs["qwen2_vl"]
    ids = {"return_token_ids": True, "min_tokens": 2}
    whole = app.chat(chat_body(_images(), **ids)).json()
    body = chat_body(_images(), stream=True, stream_options={"include_usage": True}, **ids)
    with app.client.stream("POST", f"{app.url}/v1/chat/completions", json=body) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        events = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert text == whole["choices"][0]["message"]["content"]
    streamed = [t for c in chunks if c["choices"] for t in c["choices"][0].get("token_ids", [])]
    assert streamed == whole["choices"][0]["token_ids"] and len(streamed) >= 2
    assert chunks[0]["prompt_token_ids"] == whole["prompt_token_ids"]
    assert not any("prompt_token_ids" in c for c in chunks[1:])
    finals = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
    assert finals[-1] == whole["choices"][0]["finish_reason"]
    assert chunks[-1]["usage"]["completion_tokens"] == whole["usage"]["completion_tokens"]


def test_seeded_sampling_repeats_and_differs_by_seed(pairs) -> None:
    app = pairs["llava"]

    def tokens(seed: int) -> list[str]:
        body = chat_body(_images(), temperature=1.5, seed=seed, max_tokens=12, logprobs=True)
        answer = app.chat(body).json()
        return [c["token"] for c in answer["choices"][0]["logprobs"]["content"]]

    first = tokens(1)
    assert tokens(1) == first
    assert any(tokens(s) != first for s in (2, 3, 4))


# -- errors ---------------------------------------------------------------------------------------
def test_bad_requests_get_the_apis_error_shape(pairs) -> None:
    app = pairs["qwen2_vl"]
    images = _images()

    def error(body: Any, status: int) -> dict[str, Any]:
        response = (
            app.chat(body)
            if not isinstance(body, bytes)
            else app.client.post(f"{app.url}/v1/chat/completions", content=body)
        )
        assert response.status_code == status, response.text
        return response.json()["error"]

    assert error(b"{not json", 422)["type"] == "MalformedRequestError"
    assert "messages" in error({"messages": []}, 422)["message"]
    assert "temprature" in error({**chat_body(images), "temprature": 0}, 422)["message"]
    for seed in (2**64, -(2**63) - 1):  # beyond what torch's generator takes: 422, not a 500
        seeded = {**chat_body(images), "seed": seed, "temperature": 1}
        assert "seed" in error(seeded, 422)["message"]
    for bad in (-1, 1.5, "a few", None, [3]):
        assert "min_tokens" in error({**chat_body(images), "min_tokens": bad}, 422)["message"]
    above = error(chat_body(images, min_tokens=NEW_TOKENS + 1), 422)  # max_tokens NEW_TOKENS
    assert (
        above["message"]
        == f"min_tokens ({NEW_TOKENS + 1}) must not exceed max_tokens ({NEW_TOKENS})"
    )
    no_limit = chat_body(images, min_tokens=app.config.prefill.max_tokens + 1)
    del no_limit["max_tokens"]
    assert "name max_tokens" in error(no_limit, 422)["message"]
    completion = chat_body(images, min_tokens=3, max_completion_tokens=2)
    assert "exceed max_completion_tokens (2)" in error(completion, 422)["message"]
    assert "return_token_ids" in error(chat_body(images, return_token_ids="maybe"), 422)["message"]
    skip = chat_body(images, skip_special_tokens="maybe")
    assert "skip_special_tokens" in error(skip, 422)["message"]
    remote = chat_body(images)
    remote["messages"][0]["content"][1]["image_url"]["url"] = "https://example.com/cat.png"
    assert "not fetched" in error(remote, 422)["message"]
    unknown = chat_body(images)
    unknown["messages"][0]["content"][1]["image_url"]["url"] = "vitserve://" + "ab" * 32
    missing = error(unknown, 404)
    assert missing["type"] == "CacheMissError" and missing["keys"] == ["ab" * 32]
    corrupt = chat_body([images[0], b"\x89PNG\r\n\x1a\n not really"])
    refused = error(corrupt, 422)
    assert refused["type"] == "ImageDecodeError" and refused["index"] == 1
    spelled = chat_body(images)
    spelled["messages"][0]["content"][0]["text"] = "look at <|image_pad|> this"
    assert "image" in error(spelled, 422)["message"]
    long = {"messages": [{"role": "user", "content": "hello " * 5000}], "max_tokens": 1}
    too_long = error(long, 400)
    assert too_long["type"] == "PromptTooLongError" and too_long["allowed"] == 4096
    # 2 MB of text: counted only as far as the context, never tokenized whole
    huge = {"messages": [{"role": "user", "content": "hello " * 350_000}], "max_tokens": 1}
    started = time.perf_counter()
    counted = error(huge, 400)
    assert counted["type"] == "PromptTooLongError" and "at least" in counted["message"]
    assert 4096 <= counted["tokens"] < 4096 + PIECE_CHARS  # where the count stopped
    assert time.perf_counter() - started < 30  # (a bound for a loaded host: ~0.1 s alone)
    near = {"messages": [{"role": "user", "content": "hello " * 1320}]}  # ~3,970 tokens
    held = error({**near, "min_tokens": 200}, 400)  # within prefill.max_tokens, past the context
    assert held["type"] == "PromptTooLongError" and "min_tokens" in held["message"]
    over = chat_body(images, max_tokens=4096)
    assert error(over, 400)["type"] == "PromptTooLongError"
    served = app.client.get(f"{app.url}/healthz").json()["model"]
    assert "not served here" in error(chat_body(images, model="gpt-4o"), 404)["message"]
    assert app.chat(chat_body(images, model=served)).json()["model"] == served


def test_an_image_already_encoded_is_named_by_its_key(pairs) -> None:
    from vitserve.client import EncoderClient

    app = pairs["qwen2_vl"]
    images = _images()
    with EncoderClient(app.encoder.url) as client:
        keys = [h.key for h in client.encode(images)]
    by_key = chat_body(images)
    for part, key in zip(by_key["messages"][0]["content"][1::2], keys, strict=True):
        part["image_url"]["url"] = f"vitserve://{key}"
    answer = app.chat(by_key).json()
    usage = answer["usage"]
    assert (usage["images_sent"], usage["images_uploaded"], usage["images_encoded"]) == (2, 0, 0)
    assert (
        answer["choices"][0]["message"]
        == app.chat(chat_body(images)).json()["choices"][0]["message"]
    )


def test_the_prefill_replica_loads_no_vision_weight(pairs) -> None:
    from ray import serve

    app = pairs["qwen2_vl"]
    handle = serve.get_deployment_handle("PrefillServer", app_name=app.name)
    health = app.client.get(f"{app.url}/healthz").json()
    assert health["family"] == "qwen2_vl" and health["chunk_size"] == CHUNK
    report = handle.load_report.remote().result()
    assert report["tensor_names"] and not any(
        n.startswith(("visual.", "model.visual.")) for n in report["tensor_names"]
    )
    assert report["bytes_read"] < report["checkpoint_bytes"]
    assert np.isfinite(report["seconds"])


@pytest.mark.parametrize("family", ["qwen2_vl", "gemma3"])
def test_a_long_prompt_is_counted_in_pieces_never_above_its_tokens(tiny_models, family) -> None:
    """``tokens_at_least`` is a lower bound of the whole text's tokens (cuts at whitespace,
    in a run without any, through a marker), and tokenizes only as far as its limit."""
    from transformers import AutoConfig, AutoTokenizer

    from vitserve.deployments.prefill.chat import PromptBuilder

    tokenizer = AutoTokenizer.from_pretrained(tiny_models[family])
    prompts = PromptBuilder.for_model(tokenizer, AutoConfig.from_pretrained(tiny_models[family]))
    rng = np.random.default_rng(0)
    words = ["hello", "world,", "42", "naïve", "東京", "\n", prompts.marker, "x" * 300]
    texts = [
        " ".join(rng.choice(words, 20_000)),
        "a" * 50_000 + prompts.marker + "b" * 40_000,  # no whitespace: cut anywhere
        (prompts.marker * 3 + " ") * 9000,
    ]
    for text in texts:
        whole = len(tokenizer(text, add_special_tokens=False)["input_ids"])
        assert prompts.tokens_at_least(text, 10**9) <= whole

    seen: list[int] = []
    counting = PromptBuilder(
        lambda piece, **kw: seen.append(len(piece)) or tokenizer(piece, **kw),
        prompts.family,
        prompts.image_token_id,
        prompts.marker,
        prompts.expansion,
    )
    text = "hello " * 2_000_000  # 12 MB
    assert counting.tokens_at_least(text, 4096) >= 4096
    assert sum(seen) <= 4096 * 6 + 2 * PIECE_CHARS  # about the limit's worth, not 12 MB


# -- a video --------------------------------------------------------------------------------------
def _video_clip(width: int = 84, height: int = 56, frames: int = 40, rate: int = 10) -> bytes:
    """``frames`` random frames of ``width`` x ``height`` at ``rate`` fps (lossless H.264). By
    default 40 of 84x56 (3x2 of Qwen2-VL's merged 28 px; 96x64 for Qwen3's 32) at 10 fps: 8
    frames sampled at 2 fps, 4 temporal patches: frames the tiny models' pixel bounds do not
    resize (the reference patchifies them as they are)."""
    import av

    rng = np.random.default_rng(7)
    buf = io.BytesIO()
    with av.open(buf, mode="w", format="mp4") as container:
        stream = container.add_stream("libx264", rate=rate)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv444p"
        stream.options = {"qp": "0"}
        for _ in range(frames):
            frame = rng.integers(0, 256, (height, width, 3), dtype=np.uint8)
            for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return buf.getvalue()


def _video_messages(image: bytes, video: bytes) -> list[dict[str, Any]]:
    clip = "data:video/mp4;base64," + base64.b64encode(video).decode()
    return [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "Look at"},
                {"type": "image_url", "image_url": {"url": data_url(image)}},
                {"type": "text", "text": "and then at the clip"},
                {"type": "video_url", "video_url": {"url": clip}},
                {"type": "text", "text": "and say what moves."},
            ],
        }
    ]


def _video_expansion(family: str, processor: Any, grid: list[int], indices: list[int]) -> str:
    """What the family's transformers processor writes for the video's ``<|video_pad|>``:
    Qwen2-VL's run of ``grid / merge**2`` tokens, or (``VideoMarks.TIMED_GROUPS``)
    ``Qwen3VLProcessor.replace_video_token`` itself (a time stamp before each temporal patch
    group), called on the clip's metadata: the processor object needs a video processor,
    which needs torchvision, so it is given its attributes alone."""
    import functools
    from types import SimpleNamespace

    import torch
    from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor
    from transformers.video_utils import VideoMetadata

    from vitserve.families import family_spec
    from vitserve.families.spec import VideoMarks

    merge, pad = processor.merge_size, "<|video_pad|>"
    if family_spec(family).placeholders.video_marks is VideoMarks.RUN:
        return pad * (int(np.prod(grid)) // merge**2)
    attributes = SimpleNamespace(
        video_processor=SimpleNamespace(
            merge_size=merge, temporal_patch_size=processor.temporal_patch_size
        ),
        vision_start_token="<|vision_start|>",
        vision_end_token="<|vision_end|>",
        video_token=pad,
        _calculate_timestamps=functools.partial(Qwen3VLProcessor._calculate_timestamps, None),
    )
    metadata = VideoMetadata(total_num_frames=40, fps=10.0, frames_indices=indices)
    inputs = {"video_grid_thw": torch.tensor([grid]), "video_metadata": [metadata]}
    return Qwen3VLProcessor.replace_video_token(attributes, inputs, 0)


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_5"])
def test_a_video_through_the_chunked_prefill_equals_the_monolithic_model(
    pairs, full_models, tiny_models, family
) -> None:
    """An image then a video in one message: every prompt position's logits against the full
    model on the image's pixels and the video's (its frames sampled as its video processor
    samples them, patchified independently: tests/encoder/test_video_families.py),
    placeholders expanded as the family's processor does (Qwen3-VL's and Qwen3.5's by
    transformers' own ``replace_video_token``: each group of two frames after its time
    stamp, laid out as a run of its own) and token types 1 (image) and 2 (video);
    Qwen2.5-VL's time-scaled positions from its ``second_per_grid_ts`` (temporal patch over
    the sampled frame rate, as its processor computes it)."""
    import json

    import torch
    from PIL import Image
    from transformers import AutoImageProcessor, AutoTokenizer

    from tests.encoder.test_video_families import reference_pixels
    from vitserve.client import EncoderClient
    from vitserve.deployments.prefill.chat import ChatRequest, template_messages
    from vitserve.deployments.prefill.chat_service import ChatService
    from vitserve.encoder.video import VideoSampling, probe, sample_indices
    from vitserve.families import family_spec

    path = tiny_models[family]
    processor = AutoImageProcessor.from_pretrained(path)
    unit = processor.patch_size * processor.merge_size
    image, video = _images()[0], _video_clip(3 * unit, 2 * unit)
    body = {"messages": _video_messages(image, video), "temperature": 0, "max_tokens": 4}
    app = pairs[family]
    with EncoderClient(app.encoder.url) as client:
        prepared = ChatService(app.config, client).prepare(body, keep_logits=True)

    model = full_models[family]
    tokenizer = AutoTokenizer.from_pretrained(path)
    config = json.loads((path / "video_preprocessor_config.json").read_text())
    sampling = VideoSampling.from_config(family_spec(family).video or {}, config)
    pixels = dict(
        processor(images=[Image.open(io.BytesIO(image)).convert("RGB")], return_tensors="pt")
    )
    video_pixels, video_grid = reference_pixels(processor, video, sampling)
    merge = model.config.vision_config.spatial_merge_size
    messages = template_messages(ChatRequest.parse({"messages": body["messages"]}))
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    image_rows = int(pixels["image_grid_thw"][0].prod()) // merge**2
    video_rows = int(np.prod(video_grid)) // merge**2
    indices = sample_indices(probe(video), sampling)
    text = text.replace("<|image_pad|>", "<|image_pad|>" * image_rows)
    text = text.replace("<|video_pad|>", _video_expansion(family, processor, video_grid, indices))
    ids = tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
    types = (ids == IMAGE_TOKEN_ID).long() + 2 * (ids == model.config.video_token_id).long()
    # 8 frames sampled of 40 at 10 fps: transformers' sampled_fps, then second_per_grid_ts
    extra = {}
    if family == "qwen2_5_vl":
        extra["second_per_grid_ts"] = torch.tensor([2 / (8 / 40 * 10)])
    with torch.no_grad():
        want = model(
            **extra,
            input_ids=ids,
            attention_mask=ids.new_ones(ids.shape),
            mm_token_type_ids=types,
            pixel_values=pixels["pixel_values"],
            image_grid_thw=pixels["image_grid_thw"],
            pixel_values_videos=video_pixels,
            video_grid_thw=torch.tensor([video_grid]),
        ).logits[0]

    layout = prepared.prefilled.layout
    assert layout.input_ids.tolist() == ids[0].tolist()
    runs = [s.num_tokens for s in layout.spans]
    groups = video_grid[0]
    assert groups == 4 and video_rows > CHUNK  # the chunks split the video
    timed = runs[1:] == [video_rows // groups] * groups  # one run per group, time stamped
    assert runs == [image_rows, video_rows] or timed, runs
    assert timed == (family in ("qwen3_vl", "qwen3_5"))
    diff = (prepared.prefilled.all_logits - want).abs().max().item()
    print(f"{family} image + video: {layout.length} tokens, max |logit diff| {diff:.3g}")
    assert diff <= LOGIT_ATOL
    assert prepared.usage["images_sent"] == 2
    assert prepared.usage["rows_pulled"] == image_rows + video_rows


def test_a_gemma4_video_through_the_chunked_prefill_equals_the_monolithic_model(
    pairs, full_models, tiny_models
) -> None:
    """Gemma 4: an image then a video of 6 frames of 480x288 at 2 fps (all sampled; the
    largest size in 48 px within its 630 patches, so not resized: 60 soft tokens a frame).
    Placeholders expanded by transformers' own ``Gemma4Processor.replace_video_token`` (each
    frame ``mm:ss <|image>`` its tokens ``<image|>``, the frames joined by spaces), the
    reference the full model on the image's pixels and the frames' patches
    (tests/encoder/test_video_families.py); every prompt position's logits."""
    from types import SimpleNamespace

    import torch
    from PIL import Image
    from transformers import AutoImageProcessor, AutoTokenizer
    from transformers.models.gemma4.processing_gemma4 import Gemma4Processor
    from transformers.video_utils import VideoMetadata

    from tests.encoder.test_video_families import _gemma4_reference
    from vitserve.client import EncoderClient
    from vitserve.deployments.prefill.chat import ChatRequest, template_messages
    from vitserve.deployments.prefill.chat_service import ChatService

    path, model = tiny_models["gemma4"], full_models["gemma4"]
    image, video = _images()[0], _video_clip(480, 288, frames=6, rate=2)
    body = {"messages": _video_messages(image, video), "temperature": 0, "max_tokens": 4}
    app = pairs["gemma4"]
    with EncoderClient(app.encoder.url) as client:
        prepared = ChatService(app.config, client).prepare(body, keep_logits=True)

    tokenizer = AutoTokenizer.from_pretrained(path)
    processor = AutoImageProcessor.from_pretrained(path)
    pixels = dict(
        processor(images=[Image.open(io.BytesIO(image)).convert("RGB")], return_tensors="pt")
    )
    image_rows = int(pixels.pop("num_soft_tokens_per_image")[0])
    frame_pixels, frame_positions = _gemma4_reference(video, 16, 630)
    per_frame = 60
    video_token = tokenizer.convert_ids_to_tokens(int(model.config.video_token_id))
    attributes = SimpleNamespace(
        boi_token=tokenizer.boi_token, eoi_token=tokenizer.eoi_token, video_token=video_token
    )
    metadata = VideoMetadata(total_num_frames=6, fps=2.0, frames_indices=list(range(6)))
    inputs = {"num_soft_tokens_per_video": [per_frame], "video_metadata": [metadata]}
    expansion = Gemma4Processor.replace_video_token(attributes, inputs, 0)
    messages = template_messages(ChatRequest.parse({"messages": body["messages"]}))
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    image_token = tokenizer.image_token
    text = text.replace(
        image_token, f"{tokenizer.boi_token}{image_token * image_rows}{tokenizer.eoi_token}"
    )
    text = text.replace(video_token, expansion, 1)
    ids = tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        want = model(
            input_ids=ids,
            attention_mask=ids.new_ones(ids.shape),
            **pixels,
            pixel_values_videos=frame_pixels,
            video_position_ids=frame_positions,
            num_frames_per_video=torch.tensor([6]),
        ).logits[0]

    layout = prepared.prefilled.layout
    assert layout.input_ids.tolist() == ids[0].tolist()
    assert [s.num_tokens for s in layout.spans] == [image_rows] + [per_frame] * 6
    assert "00:02 " in expansion  # the frames' times are in the prompt
    diff = (prepared.prefilled.all_logits - want).abs().max().item()
    print(f"gemma4 image + video: {layout.length} tokens, max |logit diff| {diff:.3g}")
    assert diff <= LOGIT_ATOL
    assert prepared.usage["rows_pulled"] == image_rows + 6 * per_frame


def test_a_video_part_of_a_family_whose_videos_the_prefill_does_not_take_is_refused(
    pairs,
) -> None:
    clip = "data:video/mp4;base64," + base64.b64encode(_video_clip()).decode()
    part = {"type": "video_url", "video_url": {"url": clip}}
    for family, want in (("gemma3", "videos its prefill does not take"), ("llava", "")):
        body = {"messages": [{"role": "user", "content": [part]}], "max_tokens": 2}
        answer = pairs[family].chat(body)
        assert answer.status_code == 422 and want in answer.text, (family, answer.text)
    image_as_video = {"type": "video_url", "video_url": {"url": data_url(_images()[0])}}
    body = {"messages": [{"role": "user", "content": [image_as_video]}], "max_tokens": 2}
    answer = pairs["qwen2_vl"].chat(body)
    assert answer.status_code == 422 and "a video_url part holds an image" in answer.text
