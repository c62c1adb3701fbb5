"""A store shared with others: signed entries, namespaces, and maintenance that stays
inside the store (issue 14, security and data-loss cases; each failed before the fix)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import redis
import torch

from cacheblend import Engine
from cacheblend.integrations.registry import ChunkMatcher, read_passages, register_passages
from cacheblend.store import DiskStore, NotAStore, RedisStore, Signer, open_store, parse_size
from conftest import make_tiny_model

KEY = "ab" + "7" * 62
VICTIM, ATTACKER = "The password is swordfish.", "The password is trustno1."
QUESTION = "What is the password?"
GEN = dict(max_new_tokens=8, recompute_ratio=0.0)  # full reuse: the answer rests on the stored cache


@pytest.fixture(scope="module")
def model(tmp_path_factory, default_model_dir):
    return make_tiny_model(tmp_path_factory.mktemp("trust"), "llama", default_model_dir)


def _kv(seed=0, tokens=6):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(4, 2, tokens, 16, generator=g), torch.randn(4, 2, tokens, 16, generator=g)


def _chunk(seed=0):
    from cacheblend.store import ChunkKV

    return ChunkKV(*_kv(seed), {"model": "m"})


def _forge(client, prefix: str, source_key: str, target_key: str) -> None:
    """What a writer with access to the Redis tier can do: copy the K/V of their own chunk
    under another chunk's key, with a meta record whose digests match."""
    meta = json.loads(client.get(f"{prefix}:{source_key}:meta"))
    for i in range(int(meta["layers"])):
        client.set(f"{prefix}:{target_key}:{i}", client.get(f"{prefix}:{source_key}:{i}"))
    meta["key"] = target_key
    meta.pop("signature", None)
    client.set(f"{prefix}:{target_key}:meta", json.dumps(meta))


# -- 1. signed entries ------------------------------------------------------------------
def test_a_forged_entry_in_a_shared_redis_is_rejected_recomputed_and_never_promoted(model, tmp_path, redis_server):
    client = redis.Redis.from_url(redis_server.url)
    client.flushdb()
    spec = f"memory,disk:{tmp_path / 'kv'},{redis_server.url},key=s3cret"
    reference = Engine.load(model, store="memory").generate(QUESTION, [VICTIM], **GEN)

    attacker = Engine.load(model, store=redis_server.url)  # a writer without the secret
    victim_key, forged_key = attacker.ingest([VICTIM, ATTACKER])[0].key, attacker.handle(ATTACKER).key
    served = Engine.load(model, store=redis_server.url).generate(QUESTION, [VICTIM], **GEN)
    assert served.stats.store_hits >= 1  # without a secret, a shared tier trusts every writer
    _forge(client, "cacheblend", forged_key, victim_key)

    engine = Engine.load(model, store=spec)
    result = engine.generate(QUESTION, [VICTIM], **GEN)
    assert result.token_ids == reference.token_ids
    assert result.stats.store_rejected >= 1
    engine.store.flush()
    disk, red = engine.store.tiers[1], engine.store.tiers[2]
    assert red.unsigned >= 1 and red.stats()["signed"] is True  # the forged chunk (and the unsigned system prefix)
    # replaced by a signed entry in every tier; the forged bytes went nowhere
    assert red.get(victim_key) is not None and disk.get(victim_key) is not None
    assert torch.equal(disk.get(victim_key).k, engine.store.tiers[0].get(victim_key).k)
    assert Engine.load(model, store=spec).generate(QUESTION, [VICTIM], **GEN).stats.store_rejected == 0
    client.flushdb()


def test_tiers_with_a_key_reject_unsigned_and_wrongly_signed_entries(tmp_path, redis_server):
    for make in (lambda s: DiskStore(tmp_path / "d", signer=s),
                 lambda s: RedisStore(redis_server.url, prefix="signed", signer=s)):
        plain, other, mine = make(None), make(Signer("other")), make(Signer("mine"))
        for writer in (plain, other):
            writer.put(KEY, _chunk())
            assert mine.get(KEY) is None and mine.unsigned >= 1
            assert plain.get(KEY) is None  # dropped, not left for the next reader
        assert mine.put(KEY, _chunk()) and mine.get(KEY) is not None
        assert plain.get(KEY) is not None  # a reader without the key still reads it
        assert mine.stats()["signed"] and not plain.stats()["signed"]
        mine.clear()


def test_the_key_comes_from_the_environment_and_is_never_shown(tmp_path, monkeypatch):
    monkeypatch.setenv("CACHEBLEND_STORE_KEY", "from-env")
    store = open_store(f"disk:{tmp_path}")
    assert store.signer is not None and "from-env" not in repr(store.signer)
    with pytest.raises(ValueError) as e:
        open_store("key=hunter2")
    assert "hunter2" not in str(e.value) and "names no tier" in str(e.value)
    assert "hunter2" not in json.dumps(open_store(f"disk:{tmp_path},key=hunter2").stats())


def test_an_empty_key_is_refused_and_a_key_spelled_otherwise_is_still_the_key(tmp_path, monkeypatch):
    """``key=`` from an unset template variable used to give an unsigned store silently, and
    ``KEY=s`` or ``key =s`` became a tier name that the unknown-tier error printed."""
    monkeypatch.delenv("CACHEBLEND_STORE_KEY", raising=False)
    with pytest.raises(ValueError, match="empty key="):
        open_store(f"disk:{tmp_path},key=")
    for spec in ("KEY=hunter2", "key =hunter2", " Key = hunter2"):
        store = open_store(f"disk:{tmp_path},{spec}")
        assert store.signer is not None
    with pytest.raises(ValueError) as e:
        open_store("KEY = hunter2")
    assert "hunter2" not in str(e.value)


def test_secrets_with_commas_are_whole_and_errors_never_show_a_password(tmp_path, monkeypatch):
    """The spec was split at every comma: ``key=a,b`` signed with ``a`` and printed ``b``
    as an unknown tier; redis-py's error for ``redis://:se,cret@host`` quoted the password;
    an upper-case scheme was an unknown tier, printed whole."""
    import traceback

    monkeypatch.delenv("CACHEBLEND_STORE_KEY", raising=False)
    store = open_store(f"disk:{tmp_path},key=hunter,2")
    assert store.signer is not None and store.put(KEY, _chunk())
    assert DiskStore(tmp_path, signer=Signer("hunter,2")).open(KEY) is not None  # signed with the whole key
    assert DiskStore(tmp_path, signer=Signer("hunter")).open(KEY) is None
    assert type(open_store("REDIS://:pw@127.0.0.1:1/0")).__name__ == "RedisStore"  # no connection yet
    for spec in ("redis://:Zq7,Wk9@host:x/0", "REDIS://:Zq7:Wk9@host:port/0", "nope://:Zq7Wk9@host,key=hunter2",
                 "memory,bogus,key=hunter2,3"):
        with pytest.raises(ValueError) as e:
            open_store(spec)
        shown = "".join(traceback.format_exception(e.value))
        assert all(s not in shown for s in ("Zq7", "Wk9", "hunter2")), shown


# -- namespaces --------------------------------------------------------------------------
def test_namespaces_isolate_entries_and_registries(tmp_path, redis_server):
    for spec in (f"disk:{tmp_path}", redis_server.url):
        a, b = open_store(f"{spec},namespace=acme"), open_store(f"{spec},namespace=globex")
        plain = open_store(spec)
        assert a.put(KEY, _chunk(1))
        assert b.get(KEY) is None and plain.get(KEY) is None
        b.put(KEY, _chunk(2))
        plain.clear()
        b.clear()
        assert torch.equal(a.get(KEY).k, _chunk(1).k)
        a.clear()
    register_passages(redis_server.url, ["acme's passage"], namespace="acme")
    assert read_passages(redis_server.url, namespace="globex") == []
    assert read_passages(redis_server.url) == [] or "acme's passage" not in read_passages(redis_server.url)
    matcher = ChunkMatcher(str.split, path=redis_server.url, namespace="acme")
    matcher.refresh()
    assert "acme's passage" in matcher._texts  # noqa: SLF001
    with pytest.raises(ValueError, match="namespace"):
        open_store(f"disk:{tmp_path},namespace=../../etc")


# -- 2. deletes outside the store ----------------------------------------------------------
def _cli(*args):
    return subprocess.run([sys.executable, "-m", "cacheblend.cli", *args], capture_output=True, text=True,
                          timeout=120)


def test_store_commands_refuse_a_directory_that_is_not_a_store(tmp_path):
    home = tmp_path / "home"
    (home / "ab").mkdir(parents=True)
    precious = home / "ab" / f"{KEY}.safetensors"
    precious.write_bytes(b"my own file")
    for action in ("clear", "gc", "verify", "stats"):
        out = _cli("store", action, "--store", f"disk:{home}", "--yes")
        assert out.returncode != 0 and "not a CacheBlend store" in out.stderr, out.stderr
    assert precious.read_bytes() == b"my own file" and not (home / "index.sqlite3").exists()
    out = _cli("store", "stats", "--store", f"disk:{tmp_path / 'nothing'}")
    assert out.returncode != 0 and "no CacheBlend store" in out.stderr and not (tmp_path / "nothing").exists()
    with pytest.raises(NotAStore):
        DiskStore(home)


def test_store_commands_never_follow_a_symlink_out_of_the_store(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    victim = outside / f"{'cd' + '1' * 62}.safetensors"
    victim.write_bytes(b"not yours")
    store = DiskStore(tmp_path / "kv")
    store.put(KEY, _chunk())
    (tmp_path / "kv" / "cd").symlink_to(outside, target_is_directory=True)
    (tmp_path / "kv" / "ab" / f"{'ab' + '9' * 62}.safetensors").symlink_to(victim)
    for action in ("verify", "gc", "clear"):
        out = _cli("store", action, "--store", f"disk:{tmp_path / 'kv'}", "--yes")
        assert out.returncode == 0, out.stderr
    assert victim.read_bytes() == b"not yours"
    assert DiskStore(tmp_path / "kv").get(KEY) is None  # our own entry was cleared
    assert store.delete("cd" + "1" * 62) is False and victim.exists()


def test_sizes_must_be_finite_and_positive():
    for bad in ("inf", "nan", "0", "-5GB", "1e400"):
        with pytest.raises(ValueError, match="size"):
            open_store(f"memory:{bad}")
    assert parse_size("1.5KB") == 1500


def _retag(path, old: bytes, new: bytes) -> None:
    """Rewrite a safetensors file's tensor dtypes in its header (same width: the bytes and
    the signed metadata stay as they were)."""
    data = bytearray(path.read_bytes())
    size = int.from_bytes(data[:8], "little")
    header = bytes(data[8:8 + size])
    assert old in header
    data[8:8 + size] = header.replace(old, new)
    path.write_bytes(bytes(data))


def test_a_signed_entry_read_as_another_dtype_is_rejected(tmp_path):
    """The signature covers the header's metadata and the digests hash raw bytes: a writer
    without the key could relabel the tensors F32 -> I32 (or BF16 -> F16) and the entry was
    served as garbage of that dtype."""
    from cacheblend.store import CorruptEntry

    store = DiskStore(tmp_path / "kv", signer=Signer("s3cret"))
    assert store.put(KEY, _chunk())
    (path,) = [p for p in (tmp_path / "kv").rglob("*.safetensors")]
    _retag(path, b'"F32"', b'"I32"')
    source = store.open(KEY)
    with pytest.raises(CorruptEntry, match="dtype"):
        source.layer(0)
    assert store.open(KEY) is None  # condemned: recomputed next time, never served


def test_verify_under_the_wrong_key_drops_nothing(tmp_path):
    """``cacheblend store verify`` with a mistyped key (or a stray CACHEBLEND_STORE_KEY)
    dropped every entry as badly signed, a shared Redis tier's too, and exited 0."""
    spec = f"disk:{tmp_path / 'kv'}"
    signed = open_store(f"{spec},key=right")
    keys = [f"{i + 1:064x}" for i in range(3)]
    for i, key in enumerate(keys):
        assert signed.put(key, _chunk(i))
    out = _cli("store", "verify", "--store", f"{spec},key=wrong")
    assert out.returncode == 2 and "fail their signature" in out.stderr and "nothing was dropped" in out.stderr
    assert len(DiskStore(tmp_path / "kv")) == 3
    good = _cli("store", "verify", "--store", f"{spec},key=right")
    assert good.returncode == 0 and json.loads(good.stdout)[0]["dropped"] == 0


def test_a_redis_password_in_the_query_is_hidden_too():
    """redis-py takes ``?password=`` as well as ``:password@``; only the second was hidden
    (``store stats``, the tier's warnings, ``cacheblend serve``'s banner)."""
    from cacheblend.store.redis_tier import redact
    from cacheblend.store.spec import hide_secrets

    url = "redis://127.0.0.1:6379/0?socket_timeout=1&password=s3cret"
    for shown in (redact(url), hide_secrets(f"memory,{url}")):
        assert "s3cret" not in shown and "password=***" in shown and "socket_timeout=1" in shown
