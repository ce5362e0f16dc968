"""The embedded corpus and its batches: disjoint splits, next-byte targets, a data order fixed by (seed, step)."""
import numpy as np
import pytest

from jaxhq.train import data


@pytest.fixture(scope="module")
def ds():
    return data.load(data.DataConfig(batch_size=4, seq_len=32, max_bytes=400_000, chunk=1024, val_every=10))


def test_corpus_is_embedded_text():
    b = data.corpus_bytes(400_000)
    assert len(b) == 400_000
    from pydoc_data.topics import topics
    assert topics[sorted(topics)[0]].encode()[:200] in b  # the help texts come first
    assert b"def " in b and b"import " in b  # then standard-library code


def test_split_is_by_chunks_and_disjoint(ds):
    cfg = ds.config
    n = len(data.corpus_bytes(cfg.max_bytes)) // cfg.chunk
    assert len(ds.val) == (n // cfg.val_every) * cfg.chunk
    assert len(ds.train) + len(ds.val) == n * cfg.chunk
    full = np.frombuffer(data.corpus_bytes(cfg.max_bytes), np.uint8)
    i = cfg.val_every - 1  # the first validation chunk
    np.testing.assert_array_equal(ds.val[:cfg.chunk], full[i * cfg.chunk:(i + 1) * cfg.chunk])
    np.testing.assert_array_equal(ds.train[i * cfg.chunk:(i + 1) * cfg.chunk],
                                  full[(i + 1) * cfg.chunk:(i + 2) * cfg.chunk])


def test_batches_are_next_byte_windows(ds):
    b = ds.train_batch(7)
    assert b["inputs"].shape == b["targets"].shape == (4, 32) and b["inputs"].dtype == np.int32
    np.testing.assert_array_equal(b["inputs"][:, 1:], b["targets"][:, :-1])
    for row_in, row_t in zip(b["inputs"], b["targets"]):  # each row is a real window of the train split
        s = bytes(row_in.astype(np.uint8)) + bytes([row_t[-1]])
        assert s in ds.train.tobytes()


def test_data_order_depends_on_seed_and_step_only(ds):
    again = data.load(ds.config)
    np.testing.assert_array_equal(ds.train_batch(3)["inputs"], again.train_batch(3)["inputs"])
    assert not np.array_equal(ds.train_batch(3)["inputs"], ds.train_batch(4)["inputs"])
    other = data.load(data.DataConfig(**{**ds.config.__dict__, "seed": 1}))
    assert not np.array_equal(ds.train_batch(3)["inputs"], other.train_batch(3)["inputs"])


def test_val_batches_are_fixed_and_cover_the_split(ds):
    v1, v2 = ds.val_batches(3), ds.val_batches(3)
    assert len(v1) == 3
    for a, b in zip(v1, v2):
        np.testing.assert_array_equal(a["inputs"], b["inputs"])
    assert ds.val[:32].tolist() == v1[0]["inputs"][0].tolist()  # starts at the start of the split


def test_too_small_corpus_is_a_clear_error():
    with pytest.raises(ValueError, match="too small"):
        data.load(data.DataConfig(max_bytes=10_000, chunk=4096))
