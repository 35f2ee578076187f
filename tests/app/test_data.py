"""PromptDataset: JSONL / Parquet layouts, malformed rows, shuffled resumable epochs, rendering."""

import json
import logging

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from mxrl.app.data import PromptDataset, encode_prompt, render_prompt
from mxrl.models.tokenizer import CharTokenizer


def _write_jsonl(path, rows):
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n")
    return path


def _dapo_row(i):
    return {
        "data_source": "math_dapo",
        "prompt": [{"role": "user", "content": f"problem {i}"}],
        "ability": "MATH",
        "reward_model": {"ground_truth": str(i), "style": "rule-lighteval/MATH_v2"},
        "extra_info": {"index": f"id-{i}"},
    }


def test_plain_string_prompts_from_jsonl(tmp_path):
    path = _write_jsonl(tmp_path / "d.jsonl", [{"prompt": "1+1=", "label": "2"}, {"prompt": "x"}])
    ds = PromptDataset.from_file(path, label_key=None)
    assert len(ds) == 2 and ds[0].prompt == "1+1=" and ds[0].label is None and not ds.skipped


def test_slime_chat_layout(tmp_path):
    rows = [{"prompt": [{"content": "what is 2+2?", "role": "user"}], "label": "4"}]
    ds = PromptDataset.from_file(_write_jsonl(tmp_path / "d.jsonl", rows))
    assert ds[0].prompt == [{"role": "user", "content": "what is 2+2?"}] and ds[0].label == "4"


def test_verl_dapo_parquet_layout_with_a_dotted_label_key(tmp_path):
    path = tmp_path / "dapo.parquet"
    pq.write_table(pa.Table.from_pylist([_dapo_row(i) for i in range(5)]), path)
    ds = PromptDataset.from_file(path, label_key="reward_model.ground_truth")
    assert len(ds) == 5 and ds[3].label == "3" and ds[3].index == 3
    assert ds[3].prompt == [{"role": "user", "content": "problem 3"}]
    assert ds[3].row["extra_info"] == {"index": "id-3"}


def test_malformed_rows_are_counted_and_reported(tmp_path, caplog):
    rows = [
        {"prompt": "ok", "label": "1"},  # row 0
        "{not json",  # row 1
        {"label": "1"},  # row 2: missing prompt
        {"prompt": 5, "label": "1"},  # row 3: wrong type
        {"prompt": "   ", "label": "1"},  # row 4: empty
        "",  # row 5: blank line, not a row
        {"prompt": [{"role": "user"}], "label": "1"},  # row 6: message without content
        {"prompt": "ok", "label": None},  # row 7: null label
        "[1, 2]",  # row 8: not an object
        {"prompt": [], "label": "1"},  # row 9: no messages
        {"prompt": "fine", "label": 3},  # row 10
    ]
    with caplog.at_level(logging.WARNING, logger="mxrl.app.data"):
        ds = PromptDataset.from_file(_write_jsonl(tmp_path / "d.jsonl", rows))
    assert [e.index for e in ds] == [0, 10] and ds[1].label == 3
    got = {s.row: s.reason for s in ds.skipped}
    assert sorted(got) == [1, 2, 3, 4, 6, 7, 8, 9]
    assert got[1].startswith("bad JSON: line 2")
    assert got[2] == "missing key: 'prompt'"
    assert got[3].startswith("wrong type") and got[4].startswith("empty prompt")
    assert "content" in got[6] and got[7].startswith("empty label")
    assert "skipped 8 of 10 rows" in caplog.text and "d.jsonl" in caplog.text


def test_bad_utf8_line_is_skipped(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_bytes(b'{"prompt": "a", "label": "1"}\n\xff\xfe\n')
    ds = PromptDataset.from_file(path)
    assert len(ds) == 1 and ds.skipped[0].reason.startswith("bad encoding")


def test_an_all_bad_file_is_an_error_naming_it(tmp_path):
    path = _write_jsonl(tmp_path / "bad.jsonl", ["{oops", {"q": "x"}])
    with pytest.raises(ValueError, match=r"bad\.jsonl: no usable rows.*row 0: bad JSON"):
        PromptDataset.from_file(path)
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(ValueError, match=r"empty\.jsonl: no usable rows; the file holds no rows"):
        PromptDataset.from_file(tmp_path / "empty.jsonl")
    with pytest.raises(ValueError, match="does not exist"):
        PromptDataset.from_file(tmp_path / "missing.jsonl")
    (tmp_path / "d.csv").write_text("prompt,label\n")
    with pytest.raises(ValueError, match=r"unknown dataset format '\.csv'"):
        PromptDataset.from_file(tmp_path / "d.csv")
    (tmp_path / "broken.parquet").write_bytes(b"not parquet")
    with pytest.raises(ValueError, match=r"broken\.parquet: not a readable Parquet"):
        PromptDataset.from_file(tmp_path / "broken.parquet")


@pytest.mark.parametrize("suffix", [".jsonl", ".json"])
def test_a_utf8_byte_order_mark_keeps_the_first_row(tmp_path, suffix):
    """Windows editors write EF BB BF first: it is not part of row 0."""
    rows = [{"prompt": "1+1=", "label": "2"}, {"prompt": "2+2=", "label": "4"}]
    lines = tmp_path / f"lines{suffix}"
    lines.write_bytes(b"\xef\xbb\xbf" + "\n".join(json.dumps(r) for r in rows).encode() + b"\n")
    ds = PromptDataset.from_file(lines, shuffle=False)
    assert [(e.index, e.prompt) for e in ds] == [(0, "1+1="), (1, "2+2=")] and not ds.skipped
    if suffix == ".json":  # one JSON array after the mark
        array = tmp_path / "array.json"
        array.write_bytes(b"\xef\xbb\xbf" + json.dumps(rows).encode())
        assert [e.label for e in PromptDataset.from_file(array, shuffle=False)] == ["2", "4"]


def test_json_array_and_limit(tmp_path):
    path = tmp_path / "d.json"
    path.write_text(json.dumps([{"prompt": f"p{i}", "label": str(i)} for i in range(10)]))
    assert len(PromptDataset.from_file(path, limit=4)) == 4


def _dataset(n=7, seed=0, shuffle=True):
    rows = [{"prompt": f"p{i}", "label": str(i)} for i in range(n)]
    return PromptDataset.from_rows(rows, seed=seed, shuffle=shuffle)


def _ids(batch):
    return [e.index for e in batch]


def test_shuffled_epochs_are_deterministic_permutations():
    a, b = _dataset(), _dataset()
    first = [_ids(a.next_batch(7)) for _ in range(3)]
    assert first == [_ids(b.next_batch(7)) for _ in range(3)]
    assert all(sorted(epoch) == list(range(7)) for epoch in first)
    assert first[0] != first[1]  # reshuffled each epoch
    assert _ids(_dataset(seed=1).next_batch(7)) != first[0]
    assert _ids(_dataset(shuffle=False).next_batch(9)) == [0, 1, 2, 3, 4, 5, 6, 0, 1]


def test_batches_cross_epochs_and_resume_from_state():
    ds = _dataset()
    ds.next_batch(5)
    crossing = ds.next_batch(4)  # 2 from epoch 0, 2 from epoch 1
    assert ds.epoch == 1 and ds.position == 2 and len(crossing) == 4
    state = json.loads(json.dumps(ds.state_dict()))
    resumed = _dataset(seed=99)  # the state's seed wins: it defines the order trained on
    resumed.load_state_dict(state)
    assert [_ids(ds.next_batch(3)) for _ in range(5)] == [
        _ids(resumed.next_batch(3)) for _ in range(5)
    ]
    with pytest.raises(ValueError, match="saw 7 prompts"):
        _dataset(n=8).load_state_dict(state)


class _TemplateTokenizer:
    """Duck-typed stand-in for a transformers tokenizer with a chat template."""

    chat_template = "fake"

    def apply_chat_template(self, messages, tokenize, add_generation_prompt):
        assert tokenize is False and add_generation_prompt is True
        return "".join(f"<{m['role']}>{m['content']}" for m in messages) + "<assistant>"

    def __call__(self, text, add_special_tokens):
        assert add_special_tokens is False
        return {"input_ids": [ord(c) for c in text]}

    def encode(self, text):
        return [ord(c) for c in text]


def test_render_and_encode_prompts():
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "2+2="}]
    char = CharTokenizer()
    assert render_prompt(msgs, char) == "be brief\n2+2="  # no template: join with newlines
    assert char.decode(encode_prompt(msgs, char)) == "be brief\n2+2="
    tpl = _TemplateTokenizer()
    assert render_prompt(msgs, tpl) == "<system>be brief<user>2+2=<assistant>"
    assert render_prompt(msgs, tpl, chat_template=False) == "be brief\n2+2="
    assert render_prompt("2+2=", tpl) == "2+2="  # strings verbatim by default
    assert render_prompt("2+2=", tpl, wrap_strings=True) == "<user>2+2=<assistant>"
    assert encode_prompt(msgs, tpl) == [ord(c) for c in render_prompt(msgs, tpl)]


def test_render_with_a_real_transformers_chat_template():
    tokenizers = pytest.importorskip("tokenizers")
    transformers = pytest.importorskip("transformers")
    chars = sorted(set("abcdefghijklmnopqrstuvwxyz0123456789 +=<>\n"))
    vocab = {"<unk>": 0, **{c: i + 1 for i, c in enumerate(chars)}}
    raw = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    raw.pre_tokenizer = tokenizers.pre_tokenizers.Split("", "isolated")
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="<unk>")
    tok.chat_template = (
        "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}"
    )
    msgs = [{"role": "user", "content": "what is 2+2"}]
    text = render_prompt(msgs, tok)
    assert text == "<user>what is 2+2\n<assistant>"
    ids = encode_prompt(msgs, tok)
    assert 0 not in ids and ids == tok(text, add_special_tokens=False)["input_ids"]
    assert len(ids) == len(text)  # one token per character, no specials added twice


def test_keeping_skips_what_its_reason_names_and_keeps_the_rest_in_stream_order():
    rows = [{"prompt": "x" * n, "label": str(n)} for n in (3, 9, 4, 12, 5)]
    ds = PromptDataset.from_rows(rows, seed=7)
    kept = ds.keeping(lambda e: f"too long: {len(e.prompt)}" if len(e.prompt) > 8 else None)
    assert [e.index for e in kept] == [0, 2, 4]
    assert [(s.row, s.reason) for s in kept.skipped] == [(1, "too long: 9"), (3, "too long: 12")]
    # the stream over the kept rows is the one a file holding only them would give
    alone = PromptDataset.from_rows([rows[i] for i in (0, 2, 4)], seed=7)
    assert [e.label for e in kept.next_batch(7)] == [e.label for e in alone.next_batch(7)]
    with pytest.raises(ValueError, match=r"no usable rows.*too long: 3"):
        ds.keeping(lambda e: f"too long: {len(e.prompt)}")
