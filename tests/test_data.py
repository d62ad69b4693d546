"""Packing, shard disjointness, a peer's own local files, and tokenizers: a locally built one, none from a path."""

import json
import os
import re
import sysconfig
from pathlib import Path

import pytest
import torch

from client.data import (
    EVAL_PER_DOCUMENT,
    ByteTokenizer,
    HFTokenizer,
    SequenceStream,
    eval_batches,
    load_documents,
    load_tokenizer,
    pack,
    shard_documents,
    stdlib_sources,
)
from client.sources import NEEDS_DATA_PATH, data_source
from swarm import DatasetSpec, SwarmError, TokenizerSpec


def local(data_path, num_shards: int = 64):
    """A local dataset as a peer reads it: the manifest's path-free spec, and this peer's --data-path."""
    return data_source(DatasetSpec(source="local", num_shards=num_shards), str(data_path))


def test_pack_cuts_fixed_length_sequences_separated_by_eos():
    tok = ByteTokenizer()
    seqs = list(pack(iter(["abc", "defgh"]), tok, 4))
    assert [s.tolist() for s in seqs] == [[97, 98, 99, tok.eos_id], [100, 101, 102, 103]]
    assert all(s.dtype == torch.long for s in seqs)
    assert tok.decode(seqs[1].tolist()) == "defg"


def test_shards_are_disjoint_and_cover_the_corpus(tmp_path):
    docs = [{"text": f"document number {i}"} for i in range(50)]
    path = tmp_path / "docs.jsonl"
    path.write_text("\n".join(json.dumps(d) for d in docs))
    seen = [[row["text"] for row in shard_documents(load_documents(local(path, 4)), 4, s)] for s in range(4)]
    flat = [t for shard in seen for t in shard]
    assert sorted(flat) == sorted(d["text"] for d in docs)  # every document exactly once
    assert all(set(a).isdisjoint(b) for i, a in enumerate(seen) for b in seen[i + 1 :])


def test_a_dataset_of_many_files_is_sharded_by_whole_files(tmp_path):
    """As with C4's 1024 files: a peer reads only its own files instead of streaming everything."""
    for f in range(8):
        rows = [{"text": f"file {f} document {i}"} for i in range(5)]
        (tmp_path / f"part-{f}.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    docs = load_documents(local(tmp_path, 4))
    assert docs.n_shards == 8
    seen = [[row["text"] for row in shard_documents(docs, 4, s)] for s in range(4)]
    assert sorted(t for shard in seen for t in shard) == sorted(
        f"file {f} document {i}" for f in range(8) for i in range(5)
    )
    for shard in seen:  # two whole files each
        assert len(shard) == 10 and len({t.split(" document")[0] for t in shard}) == 2


def test_builtin_corpus_peers_start_on_different_shards_and_never_train_on_the_held_out_one():
    # content-level disjointness is checked on local data above: the standard library repeats
    # whole files (empty __init__.py, license headers), so equal sequences can come from distinct files
    spec = DatasetSpec(num_shards=16)
    tok = ByteTokenizer()
    a = SequenceStream(data_source(spec), tok, 64, peer_seed="QmTTHcYoMY4cC37vUkomv2HbkCSEseNb4ZnmoS3dweHrr2")
    b = SequenceStream(data_source(spec), tok, 64, peer_seed="QmWr7YyYuCZxEzwh12ifKHrF4ssZKpVettPDiC76uQv9aR")
    assert a.order != b.order and a.order[0] != b.order[0]
    assert sorted(a.order) == list(range(15)) and spec.num_shards - 1 not in a.order
    assert not torch.equal(a.next_batch(8), b.next_batch(8))
    assert len(eval_batches(data_source(spec), tok, 64, 16)) == 2


def test_builtin_corpus_is_dealt_in_a_fixed_mixed_order_not_by_name():
    """By name, every shard reached encodings/'s codec tables in the same round (the held-out loss jumped
    for every peer at once); now any stretch of a shard mixes packages, the same on every machine."""
    files = stdlib_sources()
    assert files == stdlib_sources() and files != sorted(files)
    root = Path(sysconfig.get_paths()["stdlib"])
    top = [p.relative_to(root).parts[0] if len(p.relative_to(root).parts) > 1 else "." for p in files]
    for package in ("encodings", "test", "idlelib"):  # each spread over the corpus, not one stretch of it
        where = [i for i, t in enumerate(top) if t == package]
        assert where[0] < len(files) // 10 and where[-1] > len(files) * 9 // 10, package
    # the library's own sources only, every one of them: no installed package, no folder, nothing missed
    assert all("site-packages" not in p.parts and p.is_file() and p.suffix == ".py" for p in files)
    assert (root / "os.py") in files and (root / "json" / "decoder.py") in files
    assert len(files) == len(set(files)) > 500


def test_held_out_sequences_span_many_documents(tmp_path):
    docs = [{"text": f"document {i:03d} " + "x" * 500} for i in range(40)]
    path = tmp_path / "docs.jsonl"
    path.write_text("\n".join(json.dumps(d) for d in docs))
    tok = ByteTokenizer()
    sequences = torch.cat(eval_batches(local(path, 2), tok, 64, 16))
    assert sequences.shape == (16, 64)
    starts = [tok.decode(s.tolist())[:12] for s in sequences]
    names = [t for t in starts if t.startswith("document ")]
    assert len(names) == 16 // EVAL_PER_DOCUMENT and len(set(names)) == len(names)  # 2 per document, 8 documents
    assert all(int(n.split()[1]) % 2 == 1 for n in names)  # the last shard of two: odd documents only
    short = tmp_path / "short.jsonl"  # documents shorter than a sequence still fill it, packed together
    short.write_text("\n".join(json.dumps({"text": f"d{i}"}) for i in range(200)))
    packed = eval_batches(local(short, 2), tok, 32, 4)
    assert torch.cat(packed).shape == (4, 32)


def test_stream_resumes_from_its_position():
    source = data_source(DatasetSpec(num_shards=16))
    stream = SequenceStream(source, ByteTokenizer(), 32, peer_seed="p")
    stream.next_batch(5)
    position = stream.position
    expected = stream.next_batch(3)
    resumed = SequenceStream(source, ByteTokenizer(), 32, peer_seed="p", position=type(position)(**position.__dict__))
    resumed.position.sequences -= 3
    assert torch.equal(resumed.next_batch(3), expected)


def test_a_local_dataset_is_the_files_this_peer_names_with_its_own_flag(tmp_path):
    (tmp_path / "a.txt").write_text("hello world " * 50)
    (tmp_path / "b.txt").write_text("goodbye moon " * 50)
    (tmp_path / "deeper").mkdir()
    (tmp_path / "deeper" / "c.txt").write_text("third file " * 50)
    texts = [row["text"] for row in load_documents(local(tmp_path, 2))]  # a directory: every file under it
    assert len(texts) == 3 and "hello world" in texts[0] and "third file" in texts[2]
    by_glob = local(tmp_path / "*.txt")  # an absolute glob (pathlib's glob refuses those)
    assert by_glob.files == (str(tmp_path / "a.txt"), str(tmp_path / "b.txt"))
    assert local(tmp_path / "**" / "c.txt").files == (str(tmp_path / "deeper" / "c.txt"),)
    stream = SequenceStream(local(tmp_path / "b.txt", 2), ByteTokenizer(), 32, peer_seed="p")
    assert "goodbye moon" in ByteTokenizer().decode(stream.next_batch(1)[0].tolist())  # trains on that file alone
    for nothing in (tmp_path / "nope.txt", tmp_path / "*.md", "/dev/zero"):  # a device is no file: it never ends
        with pytest.raises(SwarmError, match="matches no files"):
            local(nothing)


def test_a_local_run_without_the_flag_says_what_to_give_and_others_refuse_the_flag(tmp_path):
    with pytest.raises(SwarmError, match="--data-path") as refused:
        data_source(DatasetSpec(source="local"), None)
    assert str(refused.value) == NEEDS_DATA_PATH
    (tmp_path / "a.txt").write_text("text")
    for spec in (DatasetSpec(), DatasetSpec(source="hub", path="allenai/c4")):
        with pytest.raises(SwarmError, match="--data-path is for runs whose dataset is local"):
            data_source(spec, str(tmp_path / "a.txt"))
        assert data_source(spec).files == ()


def test_a_hub_dataset_name_never_reads_this_machines_files(tmp_path, monkeypatch):
    """datasets reads a directory named like the hub dataset instead of it, and its file readers (``text``,
    ``json``) given no files read the current directory's: neither reaches ``load_dataset``."""
    import datasets

    monkeypatch.chdir(tmp_path)
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "secret.txt").write_text("a private note " * 20)
    (tmp_path / "notes.txt").write_text("another private note " * 20)
    assert [r["text"] for r in datasets.load_dataset("corpus", split="train", streaming=True)]  # what it would do
    calls = []
    monkeypatch.setattr(datasets, "load_dataset", lambda *a, **k: calls.append(a))
    for name, why in (("corpus", "exists on this machine"), ("text", "file readers"), ("json", "file readers")):
        with pytest.raises(SwarmError, match=why):
            load_documents(data_source(DatasetSpec(source="hub", path=name)))
    assert not calls


def test_auto_tokenizer_built_locally_with_tokenizers(tmp_path, monkeypatch):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    raw = Tokenizer(models.BPE(unk_token="[UNK]"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    corpus = ["def main():\n    return 42\n", "import os\nprint(os.getcwd())\n"] * 50
    raw.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=120, special_tokens=["[UNK]", "[EOS]"]))
    fast = PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="[EOS]", unk_token="[UNK]")

    tok = HFTokenizer(fast)
    ids = tok.encode("def main(): return 42")
    assert ids and all(0 <= i < tok.vocab_size for i in ids) and tok.vocab_size <= 120
    assert tok.eos_id == raw.token_to_id("[EOS]")
    assert "main" in tok.decode(ids)
    seqs = list(pack(iter(corpus[:4]), tok, 8))
    assert seqs and all(len(s) == 8 for s in seqs)

    # the run's tokenizer.name is a hub name: a directory of that name here is never loaded in its place
    for name in ("acme/tok", "tok"):
        fast.save_pretrained(tmp_path / name)
    monkeypatch.chdir(tmp_path)
    assert len(AutoTokenizer.from_pretrained("acme/tok")) == tok.vocab_size  # what transformers would do
    asked = []

    def unreachable(name, **kwargs):  # the hub, offline (the real one retries for 45 s here)
        asked.append(name)
        raise OSError("We couldn't connect to 'https://huggingface.co'")

    monkeypatch.setattr(AutoTokenizer, "from_pretrained", unreachable)
    for name in ("acme/tok", "tok"):
        with pytest.raises(SwarmError, match=re.escape(f"{os.path.join(tmp_path, name)} exists on this machine")):
            load_tokenizer(TokenizerSpec(kind="auto", name=name))
    with pytest.raises(SwarmError, match="Could not load tokenizer 'acme/missing' from the hub: We couldn't connect"):
        load_tokenizer(TokenizerSpec(kind="auto", name="acme/missing"))
    assert asked == ["acme/missing"]  # only a name that is not here reaches transformers


def test_the_exported_byte_tokenizer_gives_the_built_in_ones_ids_and_text_back():
    """``swarm-client export`` writes the built-in tokenizer as a transformers one: same ids, same text."""
    from client.byte_tokenizer import BOS, EOS, PAD, ByteTokenizer
    from client.export import byte_tokenizer_fast

    fast, ours = byte_tokenizer_fast(), ByteTokenizer()
    for text in ("def f(x):\n    return x  # é ü 中文 🙂", " leading space", "\t\x00\x7f\r\n"):
        ids = fast(text, add_special_tokens=False).input_ids
        assert ids == ours.encode(text) and fast.decode(ids) == text
    assert (fast.bos_token_id, fast.eos_token_id, fast.pad_token_id, len(fast)) == (BOS, EOS, PAD, ours.vocab_size)
