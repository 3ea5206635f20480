"""One chat completion, end to end, without Ray or HTTP: read the request, encode its images
through the client SDK (hash first), build the prompt, prefill chunk by chunk pulling only each
chunk's rows, then decode. The prefill application (``vitserve.deployments.prefill.app``) wraps it.

Invariants:

* Everything that can refuse a request does so before the answer starts (a streamed answer
  never turns into an error half-way): the request's shape, its images (the encoder's refusal
  carries the image's index), an unknown ``vitserve://`` key (``CacheMissError``), the prompt
  against the context, and the prefill itself. A prompt too long for the context is refused
  before any image is encoded when its text and its new images' sizes (read from their
  headers: ``vitserve.encoder.work``) already make it so; a text of more characters than the
  context is counted in pieces first, only as far as the context
  (``PromptBuilder.tokens_at_least``): a 40 MB prompt is never tokenized whole.
* ``usage`` reports, besides OpenAI's token counts: ``images_sent`` (image parts in the
  request), ``images_uploaded`` (distinct images whose bytes went to the encoder: the store
  lacked them), ``images_encoded`` (of those, the ones the encoder ran), ``rows_pulled`` /
  ``bytes_pulled`` (embedding rows and their bytes read for the prefill) and ``prefill_chunks``.
* ``min_tokens`` is a promise the request can keep: above the ``max_tokens`` asked for (the
  request's shape), above ``prefill.max_tokens`` when it asks for none, or with the prompt past
  the context, it is refused before any image is encoded, never cut short.
* ``return_token_ids``: the answer's ``token_ids`` are the generated ids, end token excluded
  (streamed: each chunk's own), and ``prompt_token_ids`` the prefilled prompt's, images'
  placeholders expanded (streamed: in the first chunk).
"""

from __future__ import annotations

import contextlib
import json
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from transformers import AutoTokenizer

from vitserve.client.adapters import prompt_layout
from vitserve.client.sync import EncoderClient
from vitserve.deployments.common.config import VitserveConfig
from vitserve.deployments.prefill.chat import ChatRequest, PromptBuilder, image_refs
from vitserve.deployments.prefill.generation import Generator, Prefilled, Sampling, Step
from vitserve.encoder.device import default_dtype, parse_dtype, resolve_device
from vitserve.encoder.images import image_header
from vitserve.encoder.language_model import load_language_model
from vitserve.encoder.loading import load_preprocessor
from vitserve.errors import (
    CacheMissError,
    ImageError,
    LimitExceededError,
    MalformedRequestError,
    PromptTooLongError,
)
from vitserve.families import family_spec


@dataclass
class Prepared:
    """A request after its prefill, ready to decode."""

    request: ChatRequest
    prefilled: Prefilled
    sampling: Sampling
    usage: dict[str, int]
    id: str
    created: int


class ChatService:
    """Chat completions over one model's language model and an ``EncoderClient``."""

    def __init__(self, cfg: VitserveConfig, client: EncoderClient | None) -> None:
        """``client``: an ``EncoderClient`` (may be set later, before the first ``prepare``)."""
        device = resolve_device(cfg.device)
        dtype = parse_dtype(cfg.dtype) if cfg.dtype else default_dtype(device)
        self.loaded = load_language_model(
            cfg.model, device=device, dtype=dtype, revision=cfg.revision
        )
        self.config = self.loaded.config
        self.tokenizer = AutoTokenizer.from_pretrained(cfg.model, revision=cfg.revision)
        self.prompts = PromptBuilder.for_model(self.tokenizer, self.config)
        # the checkpoint's generation_config.json, read by the loader (else the model config's)
        eos = self.loaded.model.generation_config.eos_token_id
        eos_ids = [eos] if isinstance(eos, int) else list(eos or [])
        self.generator = Generator(
            self.loaded.model, chunk_size=cfg.prefill.chunk_size, eos_ids=eos_ids
        )
        self.context = int(self.config.get_text_config().max_position_embeddings)
        # how an image's header gives its tokens (the image processor's config; no weights)
        self.rule = load_preprocessor(cfg.model, revision=cfg.revision).resize_rule()
        self.limits = cfg.limits.image_limits()
        self.client = client
        self.cfg = cfg
        self.model_name = cfg.prefill.served_model_name or cfg.model

    # -- before the answer ------------------------------------------------------------------------
    def prepare(
        self, body: Any, *, keep_logits: bool = False, client: EncoderClient | None = None
    ) -> Prepared:
        """Read, encode, prefill (see the module's invariants); raises VitserveError.
        ``client``: the ``EncoderClient`` to use (the caller's tenant's, auth on), else
        ``self.client``: its images and rows are the only ones the request can reach."""
        client = self.client if client is None else client
        assert client is not None, "the service's client is set before the first prepare"
        request = ChatRequest.parse(body)
        if request.model is not None and request.model != self.model_name:
            raise MalformedRequestError(
                f"model {request.model!r} is not served here; this "
                f"application serves {self.model_name!r}",
                404,
            )
        budget = self.cfg.prefill.max_tokens
        if request.completion_limit is None and request.min_tokens > budget:
            raise MalformedRequestError(
                f"min_tokens ({request.min_tokens}) is above the {budget} tokens this "
                f"application generates when a request names no max_tokens: name max_tokens"
            )
        refs = image_refs(request)
        allowed = self.cfg.limits.max_images_per_request
        if len(refs) > allowed:  # refused before any image is encoded
            raise LimitExceededError("max_images_per_request", len(refs), allowed)
        videos = [r.video for r in refs]
        if any(videos):
            if self.prompts.video_marker is None:
                raise MalformedRequestError(
                    f"this application serves {family_spec(self.prompts.family).name}, whose "
                    "videos its prefill does not take (it takes Qwen's and Gemma 4's)"
                )
            allowed = self.cfg.limits.max_videos_per_request
            if sum(videos) > allowed:
                raise LimitExceededError("max_videos_per_request", sum(videos), allowed)
        text = self.prompts.render(request)
        if len(text) > self.context:  # could hold more tokens than the context: counted in
            # pieces, only as far as the context, before the text is tokenized whole
            at_least = self.prompts.tokens_at_least(text, self.context)
            if at_least >= self.context:
                raise PromptTooLongError(at_least, self.context, "the prompt has at least")
        limit = request.completion_limit
        # Before any image is encoded: the prompt with each new image's tokens as its header
        # and the resize rule tell them (a key's, known after its probe, counted as none).
        before = self._tokens_before(refs)
        self._check_length(self.prompts.token_ids(text, before, videos), request)
        handles, usage = self._images(refs, client)
        groups = [h.frame_groups() for h in handles]
        ids = self.prompts.token_ids(text, [h.num_tokens for h in handles], videos, groups)
        room = self._check_length(ids, request)
        layout = prompt_layout(self.config, ids, handles)
        prefilled = self.generator.prefill(client, layout, handles, keep_logits=keep_logits)
        usage |= {
            "prompt_tokens": len(ids),
            "rows_pulled": prefilled.rows_pulled,
            "bytes_pulled": prefilled.bytes_pulled,
            "prefill_chunks": len(prefilled.chunks),
        }
        sampling = Sampling(
            max_tokens=min(limit or self.cfg.prefill.max_tokens, room),
            temperature=request.temperature,
            top_p=request.top_p,
            seed=request.seed,
            top_logprobs=request.top_logprobs or 0,
            min_tokens=request.min_tokens,
        )
        return Prepared(
            request, prefilled, sampling, usage, f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        )

    def _check_length(self, ids: list[int], request: ChatRequest) -> int:
        """The room left for the completion; PromptTooLongError if the prompt (with the
        completion asked for: ``max_tokens``, else ``min_tokens``) does not fit the context."""
        if len(ids) >= self.context:
            raise PromptTooLongError(len(ids), self.context)
        room = self.context - len(ids)
        asked = [("max_tokens", request.completion_limit), ("min_tokens", request.min_tokens)]
        for name, tokens in asked:
            if tokens is not None and tokens > room:
                raise PromptTooLongError(
                    len(ids) + tokens, self.context, f"the prompt and {name} make"
                )
        return room

    def _tokens_before(self, refs: list[Any]) -> list[int]:
        """Each image's LLM tokens as known before encoding: from its header by the family's
        resize rule (0 for a key, a video, or bytes whose header does not read: the encoder
        says what is wrong with them)."""
        out = []
        for i, ref in enumerate(refs):
            tokens = 0
            if ref.data is not None and not ref.video:
                with contextlib.suppress(ImageError):
                    width, height, _ = image_header(ref.data, index=i, limits=self.limits)
                    tokens = self.rule.tokens(width, height)
            out.append(tokens)
        return out

    def _images(self, refs: list[Any], client: EncoderClient) -> tuple[list[Any], dict[str, int]]:
        """Each image's handle, in order: bytes encoded hash first (one ``encode`` for all),
        keys looked up (``CacheMissError`` naming the ones the store lacks)."""
        handles: list[Any] = [None] * len(refs)
        datas = [(i, r.data) for i, r in enumerate(refs) if r.data is not None]
        if datas:
            for (i, _), handle in zip(datas, client.encode([d for _, d in datas]), strict=True):
                handles[i] = handle
        keyed = [(i, r.key) for i, r in enumerate(refs) if r.key is not None]
        if keyed:
            found = client.probe([k for _, k in keyed])
            missing = [k for (_, k), h in zip(keyed, found, strict=True) if h is None]
            if missing:
                raise CacheMissError(missing)
            for (i, _), held in zip(keyed, found, strict=True):
                handles[i] = held
        uploaded = {h.key: h for h in handles if h.uploaded}
        usage = {
            "images_sent": len(refs),
            "images_uploaded": len(uploaded),
            "images_encoded": sum(1 for h in uploaded.values() if not h.cached),
        }
        return handles, usage

    # -- the answer -------------------------------------------------------------------------------
    def complete(self, prepared: Prepared) -> dict[str, Any]:
        """The whole ``chat.completion`` object."""
        steps = list(self.generator.decode(prepared.prefilled, prepared.sampling))
        choice: dict[str, Any] = {
            "index": 0,
            "message": {"role": "assistant", "content": self._text(prepared, steps)},
            "finish_reason": _finish(prepared, len(steps)),
            "logprobs": self._logprobs(steps) if prepared.request.logprobs else None,
        }
        answer = {
            **self._envelope(prepared, "chat.completion"),
            "choices": [choice],
            "usage": self._usage(prepared, len(steps)),
        }
        if prepared.request.return_token_ids:
            choice["token_ids"] = [s.token for s in steps]
            answer["prompt_token_ids"] = _prompt_ids(prepared)
        return answer

    def stream(
        self, prepared: Prepared, on_done: Callable[[int], None] | None = None
    ) -> Iterator[str]:
        """The answer as server-sent events: a role chunk, one chunk per token (its text delta,
        held back while it ends inside a UTF-8 sequence), a final chunk with the finish reason,
        the usage chunk when ``stream_options.include_usage``, then ``[DONE]``. ``on_done`` is
        called with the number of tokens generated once the last token is out."""
        envelope = self._envelope(prepared, "chat.completion.chunk")
        logprobs, token_ids = prepared.request.logprobs, prepared.request.return_token_ids

        def event(delta: dict[str, Any], finish: str | None = None, steps: Any = None) -> str:
            lp = self._logprobs(steps) if logprobs and steps else None
            choice = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": lp}
            if token_ids and steps:
                choice["token_ids"] = [s.token for s in steps]
            return f"data: {json.dumps({**envelope, 'choices': [choice]})}\n\n"

        if token_ids:  # the prompt's ids ride on the first chunk
            envelope["prompt_token_ids"] = _prompt_ids(prepared)
        yield event({"role": "assistant", "content": ""})
        envelope.pop("prompt_token_ids", None)
        tokens: list[int] = []
        sent, pending = "", []
        for step in self.generator.decode(prepared.prefilled, prepared.sampling):
            tokens.append(step.token)
            pending.append(step)
            text = self._text(prepared, tokens)
            if text.endswith("\ufffd"):
                continue
            yield event({"content": text[len(sent) :]}, steps=pending)
            sent, pending = text, []
        if pending:
            yield event({"content": self._text(prepared, tokens)[len(sent) :]}, steps=pending)
        if on_done is not None:
            on_done(len(tokens))
        yield event({}, _finish(prepared, len(tokens)))
        options = prepared.request.stream_options
        if options is not None and options.include_usage:
            body = {**envelope, "choices": [], "usage": self._usage(prepared, len(tokens))}
            yield f"data: {json.dumps(body)}\n\n"
        yield "data: [DONE]\n\n"

    def _envelope(self, prepared: Prepared, kind: str) -> dict[str, Any]:
        return {
            "id": prepared.id,
            "object": kind,
            "created": prepared.created,
            "model": self.model_name,
        }

    def _usage(self, prepared: Prepared, completion: int) -> dict[str, int]:
        usage = prepared.usage
        return {
            "prompt_tokens": usage["prompt_tokens"],
            "completion_tokens": completion,
            "total_tokens": usage["prompt_tokens"] + completion,
            **{k: v for k, v in usage.items() if k != "prompt_tokens"},
        }

    def _text(self, prepared: Prepared, tokens: list[Any]) -> str:
        """The text of ``tokens`` (ids or steps), special tokens left out unless the request
        says ``skip_special_tokens: false``."""
        ids = [t.token if isinstance(t, Step) else t for t in tokens]
        return self.tokenizer.decode(ids, skip_special_tokens=prepared.request.skip_special_tokens)

    def _logprobs(self, steps: list[Step]) -> dict[str, Any]:
        def entry(token: int, logprob: float) -> dict[str, Any]:
            text = self.tokenizer.convert_ids_to_tokens(token)
            return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

        return {
            "content": [
                entry(s.token, s.logprob) | {"top_logprobs": [entry(*t) for t in s.top]}
                for s in steps
            ]
        }


def _prompt_ids(prepared: Prepared) -> list[int]:
    """The prompt as prefilled: its token ids, each image's placeholders expanded."""
    return [int(i) for i in prepared.prefilled.layout.input_ids]


def _finish(prepared: Prepared, generated: int) -> str:
    """OpenAI's finish reason: ``length`` when the token budget ran out, else ``stop`` (an
    end-of-sequence token, which is not returned)."""
    return "length" if generated == prepared.sampling.max_tokens else "stop"


__all__ = ["ChatService", "Prepared"]
