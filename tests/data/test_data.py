"""jaxmoe.data: the byte tokenizer, the corpora (the standard library's sources, user files),
the held-out split, the unigram baseline, and the packed batches (every byte once an epoch, in
order; segments, positions and the loss mask; determinism, resumption and sharding)."""

import json
import logging

import numpy as np
import pytest

from jaxmoe.data import (
    BOS,
    EOS,
    PAD,
    VOCAB_SIZE,
    Document,
    PackedBatches,
    decode,
    encode,
    shard_batch,
    split_documents,
    stdlib_corpus,
    text_corpus,
    unigram_entropy_bits,
)

from bitwise import assert_bitwise, differs


@pytest.fixture(scope="module")
def stdlib():
    return stdlib_corpus()


def unique_byte_corpus(lengths):
    """Documents whose bytes are all distinct: document i holds i * 16 + k at offset k."""
    assert len(lengths) <= 16 and max(lengths) <= 16
    return [Document(f"doc{i}", bytes(i * 16 + k for k in range(n))) for i, n in enumerate(lengths)]


def full_rows(batch):
    """(tokens, segment ids) of the packed rows [B, S + 1] a batch was cut from."""
    rows = np.concatenate([batch["inputs"], batch["targets"][:, -1:]], 1)
    last_seg = batch["segment_ids"][:, -1]
    # the last token is in the last input's segment, or starts a new one, or is padding
    last = np.where(
        batch["loss_mask"][:, -1], last_seg, np.where(rows[:, -1] == PAD, 0, last_seg + 1)
    )
    return rows, np.concatenate([batch["segment_ids"], last[:, None]], 1)


def epoch_batches(docs, **kwargs):
    return list(PackedBatches(docs, num_epochs=1, **kwargs))


def check_structure(batch, seq_len, batch_size):
    """Shapes and dtypes; the segments, positions and loss mask of each row."""
    assert {k: (v.shape, v.dtype.name) for k, v in batch.items()} == {
        "inputs": ((batch_size, seq_len), "int32"),
        "targets": ((batch_size, seq_len), "int32"),
        "segment_ids": ((batch_size, seq_len), "int32"),
        "positions": ((batch_size, seq_len), "int32"),
        "loss_mask": ((batch_size, seq_len), "bool"),
    }
    np.testing.assert_array_equal(batch["inputs"][:, 1:], batch["targets"][:, :-1])
    rows, seg = full_rows(batch)
    assert rows.min() >= 0 and rows.max() < VOCAB_SIZE
    for tokens, s, pos in zip(rows, seg, batch["positions"]):
        real = tokens != PAD
        np.testing.assert_array_equal(s == 0, ~real)
        assert not np.any(real[1:] & ~real[:-1]), "padding only at the end of a row"
        if real[0]:
            assert s[0] == 1
        assert np.all(np.diff(s[real]) >= 0) and np.all(np.diff(s[real]) <= 1)
        new = np.concatenate([[True], s[1:] != s[:-1]])
        for j in range(seq_len):
            assert pos[j] == (0 if new[j] or not real[j] else pos[j - 1] + 1)
        for seg_id in range(1, s.max() + 1):
            piece = tokens[s == seg_id]
            at = np.flatnonzero(s == seg_id)
            assert np.all(piece[1:] != BOS) and np.all(piece[:-1] != EOS)
            # a piece not at the row's start begins its document; one not at the end ends it
            assert at[0] == 0 or piece[0] == BOS
            assert at[-1] == seq_len or piece[-1] == EOS
    in_seg, tgt_seg = seg[:, :-1], seg[:, 1:]
    np.testing.assert_array_equal(batch["loss_mask"], (in_seg == tgt_seg) & (tgt_seg > 0))
    assert not np.any(batch["loss_mask"] & (batch["targets"] == PAD))
    assert not np.any(batch["loss_mask"] & (batch["targets"] == BOS))


def test_tokenizer_round_trip():
    text = "def f(x):\n    return 'héllo, 世界 🙂'\n"
    ids = encode(text)
    assert ids.dtype == np.int32 and ids.tolist() == list(text.encode("utf-8"))
    assert decode(ids) == text
    assert decode(encode(text.encode("utf-8"))) == text
    assert decode([BOS, *encode("hi"), EOS, PAD, PAD]) == "hi"
    assert decode([0xFF, ord("A")]) == "\ufffdA"
    assert decode([]) == ""
    with pytest.raises(ValueError, match="token id 259"):
        decode([65, VOCAB_SIZE])
    with pytest.raises(ValueError, match="token id -1"):
        decode([-1])


def test_vocab_size_agrees_with_model():
    from jaxmoe.models import BYTE_VOCAB_SIZE

    assert (PAD, BOS, EOS, VOCAB_SIZE) == (256, 257, 258, BYTE_VOCAB_SIZE)


def test_stdlib_corpus(stdlib, caplog):
    names = [doc.name for doc in stdlib]
    assert len(stdlib) > 500 and sum(len(doc.data) for doc in stdlib) > 10 * 2**20
    assert names == sorted(names) and len(set(names)) == len(names)
    assert all(n.endswith(".py") and "site-packages" not in n for n in names)
    assert {"os.py", "json/__init__.py", "asyncio/base_events.py"} <= set(names)
    assert all(b"\0" not in doc.data for doc in stdlib)
    with caplog.at_level(logging.INFO, logger="jaxmoe.data"):
        again = stdlib_corpus()
    assert again == stdlib
    assert "not text skipped" in caplog.text


def test_packing_every_byte_once_in_order():
    lengths = [0, 1, 5, 16, 3, 9, 12, 2, 7, 14, 6, 0, 11, 4, 8, 10]
    docs = unique_byte_corpus(lengths)
    for seq_len, batch_size, seed in [(7, 3, 0), (7, 3, 1), (5, 2, 2), (17, 4, 3), (40, 1, 4)]:
        batches = epoch_batches(docs, seq_len=seq_len, batch_size=batch_size, seed=seed)
        pieces = {i: [] for i in range(len(docs))}
        specials = {BOS: 0, EOS: 0}
        for batch in batches:
            check_structure(batch, seq_len, batch_size)
            rows, seg = full_rows(batch)
            for tokens, s in zip(rows, seg):
                for seg_id in range(1, s.max() + 1):
                    piece = tokens[s == seg_id]
                    for special in specials:
                        specials[special] += int(np.sum(piece == special))
                    data = piece[piece < PAD]
                    if data.size:
                        doc = int(data[0]) // 16
                        assert np.all(data // 16 == doc) and np.all(np.diff(data) == 1)
                        fits = lengths[doc] + 2 <= seq_len + 1
                        # a document that fits a row is not split
                        assert not fits or (piece[0] == BOS and piece[-1] == EOS)
                        if piece[0] == BOS:
                            assert data[0] % 16 == 0
                        if piece[-1] == EOS:
                            assert data[-1] % 16 == lengths[doc] - 1
                        pieces[doc].append(data)
        assert specials == {BOS: len(docs), EOS: len(docs)}
        for i, doc in enumerate(docs):
            got = sorted(pieces[i], key=lambda p: int(p[0]))
            joined = np.concatenate(got) if got else np.zeros(0, np.int32)
            assert joined.tobytes() == np.frombuffer(doc.data, np.uint8).astype(np.int32).tobytes()


def test_packing_real_text(stdlib):
    docs = stdlib[:40]
    counts = np.bincount(np.frombuffer(b"".join(d.data for d in docs), np.uint8), minlength=256)
    for drop_remainder in (False, True):
        batches = epoch_batches(
            docs, seq_len=96, batch_size=8, seed=5, drop_remainder=drop_remainder
        )
        tokens = np.concatenate([full_rows(b)[0].reshape(-1) for b in batches])
        packed = np.bincount(tokens, minlength=VOCAB_SIZE)
        if drop_remainder:
            assert np.all(packed[:256] <= counts) and packed[PAD] < 96 * len(batches)
        else:
            np.testing.assert_array_equal(packed[:256], counts)
            assert packed[BOS] == packed[EOS] == len(docs)
        for batch in batches[:3] + batches[-2:]:
            check_structure(batch, 96, 8)


def test_packing_pads_the_last_batch_or_drops_it():
    docs = unique_byte_corpus([16] * 5)  # 18 tokens each: one row of 19 apiece
    kept = epoch_batches(docs, seq_len=18, batch_size=2, seed=0)
    dropped = epoch_batches(docs, seq_len=18, batch_size=2, seed=0, drop_remainder=True)
    assert len(kept) == 3 and len(dropped) == 2
    assert np.all(kept[-1]["inputs"][1] == PAD) and not np.any(kept[-1]["loss_mask"][1])
    for a, b in zip(kept, dropped):
        assert_bitwise(a["inputs"], b["inputs"])
    with pytest.raises(ValueError, match="fewer than batch_size 6"):
        PackedBatches(docs, seq_len=18, batch_size=6, drop_remainder=True)


def test_same_seed_same_batches_other_seed_other_batches():
    docs = unique_byte_corpus([16, 3, 9, 12, 2, 7, 14, 6, 11, 4])
    a = epoch_batches(docs, seq_len=8, batch_size=2, seed=7)
    b = epoch_batches(docs, seq_len=8, batch_size=2, seed=7)
    c = epoch_batches(docs, seq_len=8, batch_size=2, seed=8)
    assert len(a) == len(b)
    for x, y in zip(a, b):
        for key in x:
            assert_bitwise(x[key], y[key])
    assert any(differs(x["inputs"], z["inputs"]) for x, z in zip(a, c))
    # the next epoch is shuffled afresh
    pb = PackedBatches(docs, seq_len=8, batch_size=2, seed=7)
    assert differs(pb.batch_at(0)["inputs"], pb.batch_at(pb.batches_in_epoch(0))["inputs"])


def test_rows_are_shuffled():
    docs = [Document(f"d{i}", bytes([i]) * 200) for i in range(4)]  # 21 rows of 10 each
    for seed in range(3):
        first = PackedBatches(docs, seq_len=9, batch_size=8, seed=seed).batch_at(0)["inputs"]
        # packed in order, the first 8 rows would all be pieces of one document
        assert len(set(first[:, 1:].reshape(-1).tolist()) - {BOS, EOS, PAD}) > 1


def test_resume_and_batch_at_match_iteration():
    docs = unique_byte_corpus([16, 3, 9, 12, 2, 7, 14, 6, 11])
    kwargs = dict(seq_len=6, batch_size=3, seed=3, num_epochs=3)
    iterated = PackedBatches(docs, **kwargs)
    batches, states = [], []
    while True:
        states.append(json.loads(json.dumps(iterated.state())))
        try:
            batches.append(next(iterated))
        except StopIteration:
            break
    counts = [iterated.batches_in_epoch(e) for e in range(3)]
    assert len(batches) == sum(counts) and states[counts[0]] == {"epoch": 1, "index": 0}
    lookup = PackedBatches(docs, **kwargs)
    for step in [len(batches) - 1, 0, counts[0], counts[0] - 1, 5, *range(len(batches))]:
        for key in batches[step]:
            assert_bitwise(lookup.batch_at(step)[key], batches[step][key])
    for step in [1, counts[0] - 1, counts[0], counts[0] + counts[1] + 1]:
        resumed = PackedBatches(docs, **kwargs)
        resumed.restore(states[step])
        rest = list(resumed)
        assert len(rest) == len(batches) - step
        for x, y in zip(rest, batches[step:]):
            assert_bitwise(x["inputs"], y["inputs"])
    assert differs(batches[0]["inputs"], batches[1]["inputs"])
    with pytest.raises(IndexError, match=f"step {len(batches)}"):
        lookup.batch_at(len(batches))
    with pytest.raises(ValueError, match=f"state index {counts[0]}"):
        lookup.restore({"epoch": 0, "index": counts[0]})
    with pytest.raises(ValueError, match="keys"):
        lookup.restore({"epoch": 0})


def test_packing_errors():
    docs = unique_byte_corpus([5, 6])
    with pytest.raises(ValueError, match="seq_len must be an integer >= 2, got 1"):
        PackedBatches(docs, seq_len=1, batch_size=2)
    with pytest.raises(ValueError, match="batch_size must be an integer >= 1, got 0"):
        PackedBatches(docs, seq_len=8, batch_size=0)
    with pytest.raises(ValueError, match="no documents"):
        PackedBatches([], seq_len=8, batch_size=1)
    with pytest.raises(ValueError, match="all empty"):
        PackedBatches([Document("a", b""), Document("b", b"")], seq_len=8, batch_size=1)


def test_shard_batch():
    batch = PackedBatches(unique_byte_corpus([16, 9, 12, 14]), seq_len=4, batch_size=6).batch_at(0)
    shards = [shard_batch(batch, 3, i) for i in range(3)]
    for key in batch:
        assert all(s[key].shape[0] == 2 for s in shards)
        assert_bitwise(np.concatenate([s[key] for s in shards]), batch[key])
    assert differs(shards[0]["inputs"], shards[1]["inputs"])
    with pytest.raises(ValueError, match="batch size 6 does not split into 4 shards"):
        shard_batch(batch, 4, 0)
    with pytest.raises(ValueError, match="shard 3 is not below num_shards 3"):
        shard_batch(batch, 3, 3)


def test_split_by_document():
    docs = [Document(f"d{i}", bytes([i]) * (i + 1)) for i in range(200)]
    train, held = split_documents(docs, held_out_fraction=0.05, seed=1)
    assert len(held) == 10 and len(train) == 190
    assert sorted(d.name for d in train + held) == sorted(d.name for d in docs)
    assert [d for d in docs if d in held] == held and [d for d in docs if d in train] == train
    assert split_documents(docs, held_out_fraction=0.05, seed=1) == (train, held)
    assert split_documents(docs, held_out_fraction=0.05, seed=2)[1] != held
    assert len(split_documents(docs[:3], held_out_fraction=0.01)[1]) == 1
    assert len(split_documents(docs[:2], held_out_fraction=0.99)[0]) == 1
    with pytest.raises(ValueError, match="at least 2 documents, got 1"):
        split_documents(docs[:1])
    with pytest.raises(ValueError, match="held_out_fraction must be in \\(0, 1\\), got 1.5"):
        split_documents(docs, held_out_fraction=1.5)
    for seed in range(4):  # one of the two documents is held out: either split is empty
        with pytest.raises(ValueError, match=f"split \\(1 documents, seed {seed}.* has no bytes"):
            split_documents([Document("a", b"x"), Document("b", b"")], 0.5, seed)


def test_unigram_entropy():
    assert unigram_entropy_bits([Document("a", b"ab" * 50)]) == 1.0
    assert (
        unigram_entropy_bits([Document("a", b"aab"), Document("b", b""), Document("c", b"c")])
        == 1.5
    )
    assert unigram_entropy_bits([Document("a", bytes(range(256)) * 3)]) == 8.0
    assert unigram_entropy_bits([Document("a", b"zzzz")]) == 0.0
    with pytest.raises(ValueError, match="no bytes in the 1 documents"):
        unigram_entropy_bits([Document("a", b"")])


def test_text_corpus(tmp_path, caplog):
    (tmp_path / "sub").mkdir()
    (tmp_path / "b.txt").write_text("bee")
    (tmp_path / "sub" / "a.md").write_text("# a")
    (tmp_path / "a.py").write_text("x = 1\n")
    (tmp_path / "c.jsonl").write_text('{"text": "one"}\n\n{"text": "two", "id": 2}\n')
    (tmp_path / "d.csv").write_text("not,read\n")
    (tmp_path / "nul.txt").write_bytes(b"a\0b")
    (tmp_path / "latin.jsonl").write_bytes(b'{"text": "caf\xe9"}\n')
    with caplog.at_level(logging.INFO, logger="jaxmoe.data"):
        docs = text_corpus(tmp_path)
    assert "2 files not text skipped" in caplog.text
    assert [(d.name.removeprefix(str(tmp_path)), d.data) for d in docs] == [
        ("/a.py", b"x = 1\n"),
        ("/b.txt", b"bee"),
        ("/c.jsonl:1", b"one"),
        ("/c.jsonl:3", b"two"),
        ("/sub/a.md", b"# a"),
    ]
    assert text_corpus([tmp_path / "b.txt", str(tmp_path / "c.jsonl")]) == [docs[1], *docs[2:4]]


def test_text_corpus_errors(tmp_path):
    def write(name, data):
        (tmp_path / name).write_bytes(data)
        return tmp_path / name

    with pytest.raises(ValueError, match="nul.txt: not a text file"):
        text_corpus(write("nul.txt", b"a\0b"))
    with pytest.raises(ValueError, match="bad.txt: not a text file"):
        text_corpus(write("bad.txt", b"\xff\xfe"))
    with pytest.raises(ValueError, match="x.csv: unknown file type '.csv'"):
        text_corpus(write("x.csv", b"a,b"))
    with pytest.raises(ValueError, match="j.jsonl, line 2: not JSON"):
        text_corpus(write("j.jsonl", b'{"text": "a"}\n{"text": \n'))
    with pytest.raises(ValueError, match='k.jsonl, line 1: no "text" field'):
        text_corpus(write("k.jsonl", b'{"body": "a"}\n'))
    with pytest.raises(ValueError, match='l.jsonl, line 1: "text" is a int'):
        text_corpus(write("l.jsonl", b'{"text": 3}\n'))
    with pytest.raises(FileNotFoundError, match="missing.txt"):
        text_corpus(tmp_path / "missing.txt")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="empty corpus: no documents"):
        text_corpus(tmp_path / "empty")
    write("empty/e.txt", b"")
    with pytest.raises(ValueError, match="empty corpus: the 1 documents .* are all empty"):
        text_corpus(tmp_path / "empty")
