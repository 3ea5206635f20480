"""The scenarios produce requests of the declared shape."""

from __future__ import annotations

import io

from PIL import Image

from loadtest.harness.scenarios import (
    CHAT_REPLY,
    AgentConversation,
    ChatConversation,
    ImagePool,
    RandomMultimodal,
    cache_off,
    encode_error,
    tag_jpeg,
)

SMALL = ((32, 32), (48, 40))


def pool() -> ImagePool:
    return ImagePool(sizes=SMALL, per_size=2, seed=1, run_id="t")


def test_tagged_jpeg_is_new_bytes_same_pixels() -> None:
    base = pool().base((32, 32))[0]
    tagged = tag_jpeg(base, "x 1")
    assert tagged != base and tagged != tag_jpeg(base, "x 2")
    a, b = Image.open(io.BytesIO(base)), Image.open(io.BytesIO(tagged))
    assert a.size == b.size == (32, 32)
    assert a.convert("RGB").tobytes() == b.convert("RGB").tobytes()


def test_random_k_range_and_duplicate_ratio() -> None:
    gen = RandomMultimodal(pool(), k_min=1, k_max=4, duplicate_ratio=0.3, seed=3)
    seen: set[bytes] = set()
    total = dups = 0
    ks = set()
    for _ in range(400):
        req = gen.next_request()
        assert 1 <= req.k <= 4 and len(req.sizes) == req.k
        assert len(set(req.images)) == req.k  # never the same image twice in one request
        assert sum(img in seen for img in req.images) == req.duplicates
        assert set(req.sizes) <= set(SMALL)
        seen.update(req.images)
        total += req.k
        dups += req.duplicates
        ks.add(req.k)
    assert ks == {1, 2, 3, 4}
    assert 0.25 < dups / total < 0.35


def test_cache_off_every_image_new() -> None:
    gen = cache_off(pool(), seed=5)
    seen: set[bytes] = set()
    for _ in range(100):
        req = gen.next_request()
        assert req.duplicates == 0
        assert not seen & set(req.images)
        seen.update(req.images)


def test_agent_turns_resend_conversation() -> None:
    conv = AgentConversation(pool(), turns=4, seed=0)
    prev: list[bytes] = []
    for i in range(10):
        turn = i % 4 + 1
        assert conv.turn == turn
        req = conv.next_request()
        assert req.k == turn and req.duplicates == turn - 1
        if turn > 1:
            assert req.images[:-1] == prev
        assert req.images[-1] not in prev
        prev = req.images


def test_chat_turns_resend_the_conversations_images() -> None:
    conv = ChatConversation(pool(), turns=3, seed=2, model="m", max_tokens=5)
    prev: list[str] = []
    for i in range(7):
        turn = i % 3 + 1
        assert conv.turn == turn
        req = conv.next_request()
        assert (req.turn, req.k) == (turn, turn)
        body = req.body
        assert body["model"] == "m" and body["max_tokens"] == 5 and body["stream"] is True
        users = [m for m in body["messages"] if m["role"] == "user"]
        replies = [m for m in body["messages"] if m["role"] == "assistant"]
        assert len(users) == turn and len(replies) == turn - 1
        assert all(m["content"] == CHAT_REPLY for m in replies)
        urls = [m["content"][0]["image_url"]["url"] for m in users]
        assert all(u.startswith("data:image/jpeg;base64,") for u in urls)
        if turn > 1:
            assert urls[:-1] == prev  # the earlier images again, byte for byte
        assert urls[-1] not in prev
        prev = urls
    assert "model" not in ChatConversation(pool(), model=None).next_request().body


def test_encode_answers_are_checked() -> None:
    ok = {"items": [{"key": "a"}, {"key": "b"}]}
    assert encode_error(200, "", ok, 2) is None
    assert encode_error(200, "", ok, 3) == "2 items for 3 images; errors: []"
    assert "decode" in (encode_error(200, "", {"items": [{"error": "decode"}]}, 1) or "")
    assert encode_error(429, "slow down", None, 1) == "HTTP 429: slow down"
