"""OpenAI-style chat requests for the prefill application: the request schema, the images a
request names, and its prompt (the chat template, then each image's placeholders expanded to
its embedding rows).

Invariants:

* A request is read strictly: an unknown field, a role or content part vitserve does not
  serve, ``n`` other than 1, ``min_tokens`` above the ``max_tokens`` asked for, or an image URL
  other than a ``data:`` URL or ``vitserve://<key>`` is a
  :class:`~vitserve.errors.MalformedRequestError` naming it, before any work (no remote URL is
  ever fetched).
* Images are numbered in prompt order (message by message, part by part); image ``k``'s
  placeholders are one contiguous run of exactly its ``num_tokens`` image tokens, and the
  prompt holds no other image token: text that spells a placeholder is refused, never taken
  for an image.
* Expansion follows the family's own processor, as its spec's ``placeholders`` say
  (:mod:`vitserve.families`): ``Marker.IMAGE`` (Qwen, LLaVA) repeats the image token the
  template writes once per image; ``Marker.OPEN`` (Gemma 3) replaces the template's open token
  (``<start_of_image>``) with ``padding + open + image tokens + close + padding``
  (``\\n\\n<start_of_image>`` ... ``<end_of_image>\\n\\n``); ``Marker.WRAPPED_IMAGE`` (Gemma 4)
  replaces the template's image token (``<|image|>``) with ``open + image tokens + close``
  (``<|image>`` ... ``<image|>``).
* A video (a ``video_url`` part, ``data:`` or ``vitserve://``) is an item like an image, in
  the same numbering; its bytes must be a video container (and an image's must not be one).
  The family's template writes its video token once per video (``Placeholders.video``),
  expanded as its processor does (``Placeholders.video_marks``): repeated to the video's rows
  (``RUN``: Qwen2-VL, Qwen2.5-VL); per frame group ``<t seconds>`` and the group's rows
  between the open and close tokens, ``t`` the mean of its first and last frame times
  (``TIMED_GROUPS``: Qwen3-VL, Qwen3.5); per frame ``mm:ss`` and its rows between the open
  and close tokens, the frames joined by spaces (``STAMPED_FRAMES``: Gemma 4). The stamps come
  from the record's frame times. A family without a video token refuses videos at the door.
"""

from __future__ import annotations

import base64
import binascii
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from vitserve.cache.codec import FrameGroup
from vitserve.deployments.common.requests import DATA_URL
from vitserve.errors import MalformedRequestError
from vitserve.families import family_spec
from vitserve.families.spec import Marker, VideoMarks
from vitserve.media import Media, media_of

KEY_URL = re.compile(r"^vitserve://([0-9a-f]{64})$")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ImageUrl(_Strict):
    url: str
    detail: Literal["auto", "low", "high"] | None = None  # accepted, no effect


class ContentPart(_Strict):
    type: Literal["text", "image_url", "video_url"]
    text: str | None = None
    image_url: ImageUrl | None = None
    video_url: ImageUrl | None = None  # {"url": ...}: a data: URL or vitserve://<key>


class Message(_Strict):
    role: Literal["system", "user", "assistant"]
    content: str | list[ContentPart]
    name: str | None = None


class StreamOptions(_Strict):
    include_usage: bool = False


class ChatRequest(_Strict):
    """The fields of OpenAI's chat completions request that the prefill application serves.

    ``temperature`` 0 is greedy decoding; above 0 samples (``top_p``, and ``seed`` for a
    reproducible draw). ``logprobs`` are the model's own (before temperature and top-p).

    Three fields are vLLM's extensions, as its OpenAI-compatible server reads them:
    ``min_tokens`` holds the end-of-sequence tokens back for the answer's first that many tokens
    (so a model that would stop at once still answers), ``return_token_ids`` adds the prompt's
    (``prompt_token_ids``) and the answer's (each choice's ``token_ids``) token ids, and
    ``skip_special_tokens: false`` keeps special tokens in the answer's text.
    """

    model: str | None = None
    messages: list[Message] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    # torch's generators take a seed in [-2**63, 2**64): outside it, a 422 (not a 500)
    seed: int | None = Field(None, ge=-(2**63), lt=2**64)
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    user: str | None = None
    min_tokens: int = Field(0, ge=0)
    return_token_ids: bool = False
    skip_special_tokens: bool = True

    @classmethod
    def parse(cls, body: Any) -> ChatRequest:
        """The request, or MalformedRequestError naming every problem."""
        try:
            request = cls.model_validate(body)
        except ValidationError as exc:
            problems = "; ".join(
                f"{'.'.join(str(p) for p in e['loc']) or 'body'}: {e['msg']}" for e in exc.errors()
            )
            raise MalformedRequestError(f"invalid chat request: {problems}") from None
        if request.n != 1:
            raise MalformedRequestError("n must be 1 (one choice per request)")
        if request.top_logprobs and not request.logprobs:
            raise MalformedRequestError("top_logprobs needs logprobs: true")
        limit = request.completion_limit
        if limit is not None and request.min_tokens > limit:
            name = "max_completion_tokens" if request.max_completion_tokens else "max_tokens"
            raise MalformedRequestError(
                f"min_tokens ({request.min_tokens}) must not exceed {name} ({limit})"
            )
        for i, message in enumerate(request.messages):
            for j, part in enumerate(message.content if isinstance(message.content, list) else ()):
                where = f"messages[{i}].content[{j}]"
                if (
                    (part.type == "text") != (part.text is not None)
                    or (part.type == "image_url") != (part.image_url is not None)
                    or (part.type == "video_url") != (part.video_url is not None)
                ):
                    raise MalformedRequestError(
                        f"{where}: a {part.type!r} part takes {part.type!r} alone"
                    )
                if part.type != "text" and message.role != "user":
                    raise MalformedRequestError(f"{where}: images and videos go in user messages")
        return request

    @property
    def completion_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


@dataclass(frozen=True, slots=True)
class ImageRef:
    """One image or video of a request: its bytes (a data URL), or the key of one the caller
    already encoded (``vitserve://<key>``); ``video``: it came in a ``video_url`` part."""

    data: bytes | None = None
    key: str | None = None
    video: bool = False


def image_refs(request: ChatRequest) -> list[ImageRef]:
    """The request's images and videos in prompt order (MalformedRequestError for a URL
    vitserve does not take, undecodable base64, or bytes of the other kind: a video in an
    ``image_url`` part or the reverse)."""
    refs: list[ImageRef] = []
    for message in request.messages:
        for part in message.content if isinstance(message.content, list) else ():
            if part.image_url is not None:
                refs.append(_image_ref(part.image_url.url, len(refs)))
            elif part.video_url is not None:
                refs.append(_image_ref(part.video_url.url, len(refs), video=True))
    return refs


def _image_ref(url: str, index: int, video: bool = False) -> ImageRef:
    if m := KEY_URL.match(url):
        return ImageRef(key=m[1], video=video)
    m = DATA_URL.match(url)
    if m is None:
        raise MalformedRequestError(
            f"image {index}: the URL must be a data: URL or vitserve://<64 hex key> (remote "
            f"URLs are not fetched), got {url[:40]!r}"
        )
    if not m["b64"]:
        raise MalformedRequestError(f"image {index}: a data: URL must be base64")
    try:
        data = base64.b64decode(m["data"], validate=True)
    except (binascii.Error, ValueError):
        raise MalformedRequestError(f"image {index}: the data: URL is not valid base64") from None
    if (media_of(data) is Media.VIDEO) != video:
        part = "a video_url part holds an image" if video else "an image_url part holds a video"
        raise MalformedRequestError(f"item {index}: {part}")
    return ImageRef(data=data, video=video)


def template_messages(request: ChatRequest) -> list[dict[str, Any]]:
    """The messages as a chat template reads them (image parts as ``{"type": "image"}``,
    video parts as ``{"type": "video"}``)."""
    out = []
    for message in request.messages:
        content: Any = message.content
        if isinstance(content, list):
            kinds = {"text": "text", "image_url": "image", "video_url": "video"}
            content = [
                {"type": "text", "text": p.text} if p.type == "text" else {"type": kinds[p.type]}
                for p in content
            ]
        out.append({"role": message.role, "content": content})
    return out


#: characters tokenized at a time where a long prompt is counted before it is tokenized whole,
#: and the tokens each cut between two pieces may add (a split merge, a split marker)
PIECE_CHARS = 16_384
CUT_SLACK = 16


@dataclass(frozen=True)
class PromptBuilder:
    """Renders a request's prompt with the model's tokenizer and chat template, then expands
    each image marker (see the module docstring). Built once per model."""

    tokenizer: Any
    family: str
    image_token_id: int
    marker: str  # what the template writes once per image
    expansion: tuple[str, str, str]  # (before, one image token, after) per image
    # the family's video token (written once per video, repeated per row) and its id; None:
    # the family's videos are not taken (Placeholders.video)
    video_marker: str | None = None
    video_token_id: int | None = None
    # how a video's rows are laid out, and the tokens around each frame group's (by group)
    video_marks: VideoMarks = VideoMarks.RUN
    group_marks: tuple[str, str] = ("", "")

    @classmethod
    def for_model(cls, tokenizer: Any, config: Any) -> PromptBuilder:
        family = str(config.model_type)
        p = family_spec(family).placeholders  # UnsupportedModelError for an unknown family

        def token(attribute: str | None) -> str:  # the token a config attribute's id names
            if attribute is None:
                return ""
            return tokenizer.convert_ids_to_tokens(int(getattr(config, attribute)))

        image_id = int(getattr(config, p.image))
        image = token(p.image)
        opener, closer = token(p.open), token(p.close)
        video: dict[str, Any] = {"video_marks": p.video_marks, "group_marks": (opener, closer)}
        if p.video:
            video_id = int(getattr(config, p.video))
            video |= {"video_marker": token(p.video), "video_token_id": video_id}
        if p.marker is Marker.OPEN:
            expansion = (f"{p.padding}{opener}", image, f"{closer}{p.padding}")
            return cls(tokenizer, family, image_id, opener, expansion, **video)
        if p.marker is Marker.WRAPPED_IMAGE:
            return cls(tokenizer, family, image_id, image, (opener, image, closer), **video)
        return cls(tokenizer, family, image_id, image, ("", image, ""), **video)

    def render(self, request: ChatRequest) -> str:
        """The chat template's text, with one marker per image and the generation prompt."""
        try:
            return self.tokenizer.apply_chat_template(
                template_messages(request), tokenize=False, add_generation_prompt=True
            )
        except Exception as exc:  # the template's own error (jinja raise_exception, ...)
            raise MalformedRequestError(f"the chat template refused the messages: {exc}") from None

    def tokens_at_least(self, text: str, limit: int) -> int:
        """A lower bound of the tokens ``text`` holds (its markers unexpanded), found without
        tokenizing it whole: it is tokenized ``PIECE_CHARS`` at a time, cut at whitespace where
        a piece has any, until the count passes ``limit`` (the tokenizer's work is bounded by
        the limit, not by the text). A cut can split what the whole text would merge into one
        token, or a marker: ``CUT_SLACK`` tokens a cut are taken off the count."""
        count = cuts = 0
        pos = 0
        while pos < len(text) and count - CUT_SLACK * cuts <= limit:
            end = min(pos + PIECE_CHARS, len(text))
            if end < len(text):
                space = max(text.rfind(" ", pos, end), text.rfind("\n", pos, end))
                end = space if space > pos else end
                cuts += 1
            piece = text[pos:end]
            count += len(self.tokenizer(piece, add_special_tokens=False)["input_ids"])
            pos = end
        return max(count - CUT_SLACK * cuts, 0)

    def token_ids(
        self,
        text: str,
        num_tokens: Sequence[int],
        videos: Sequence[bool] = (),
        groups: Sequence[Sequence[FrameGroup]] = (),
    ) -> list[int]:
        """``text`` tokenized with item ``k``'s marker expanded to ``num_tokens[k]`` tokens
        (an image's, or where ``videos[k]`` a video's, laid out by ``video_marks``: by group,
        by its frame groups ``groups[k]``, a video without them counted as none, as before
        encoding); MalformedRequestError if the text holds another marker or image
        or video token."""
        kinds = list(videos) or [False] * len(num_tokens)
        markers = [self.marker, *([self.video_marker] if self.video_marker else [])]
        pattern = "|".join(re.escape(m) for m in markers)
        found = re.findall(pattern, text)
        parts = re.split(pattern, text)
        if [m != self.marker for m in found] != kinds:
            raise MalformedRequestError(
                f"the prompt holds {len(found)} image and video markers ({' '.join(markers)}) "
                f"for {len(num_tokens)} items: text may not spell a marker"
            )
        before, token, after = self.expansion
        groups = list(groups) or [()] * len(num_tokens)
        pieces = [parts[0]]
        for n, video, frames, part in zip(num_tokens, kinds, groups, parts[1:], strict=True):
            pieces += [self._video(n, frames) if video else before + token * n + after, part]
        ids = self.tokenizer("".join(pieces), add_special_tokens=False)["input_ids"]
        want = sum(n for n, v in zip(num_tokens, kinds, strict=True) if not v)
        video_rows = sum(
            self._video_rows(n, f) for n, v, f in zip(num_tokens, kinds, groups, strict=True) if v
        )
        if (
            sum(1 for i in ids if i == self.image_token_id) != want
            or sum(1 for i in ids if i == self.video_token_id) != video_rows
        ):
            raise MalformedRequestError(
                "the prompt's text spells the image or video token; they are reserved for "
                "images and videos"
            )
        return list(ids)

    def _video_rows(self, num_tokens: int, groups: Sequence[FrameGroup]) -> int:
        """The video tokens :meth:`_video` writes for a video of ``num_tokens`` rows."""
        return num_tokens if groups or not self.video_marks.by_group else 0

    def _video(self, num_tokens: int, groups: Sequence[FrameGroup]) -> str:
        """One video's expansion of its marker (see :class:`VideoMarks`)."""
        mark = str(self.video_marker)
        if self.video_marks is VideoMarks.RUN:
            return mark * num_tokens
        if sum(g.end - g.start for g in groups) != (num_tokens if groups else 0):
            raise MalformedRequestError(
                f"a video_url part's record ({num_tokens} rows) has no frame groups: "
                "it is not a video's"
            )
        opener, closer = self.group_marks
        runs = [f"{opener}{mark * (g.end - g.start)}{closer}" for g in groups]
        if self.video_marks is VideoMarks.TIMED_GROUPS:
            stamps = [f"<{(g.times[0] + g.times[-1]) / 2:.1f} seconds>" for g in groups]
            return "".join(stamp + run for stamp, run in zip(stamps, runs, strict=True))
        seconds = [g.times[0] for g in groups]  # STAMPED_FRAMES: a group is one frame
        stamps = [f"{int(t // 60):02d}:{int(t % 60):02d}" for t in seconds]
        return " ".join(f"{stamp} {run}" for stamp, run in zip(stamps, runs, strict=True))


__all__ = [
    "ChatRequest",
    "ImageRef",
    "PromptBuilder",
    "image_refs",
    "template_messages",
]
