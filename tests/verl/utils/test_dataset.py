"""Parquet prompt dataset (chat template, left padding, extra columns) and the resumable prompt loader."""
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from verl.utils.dataset import PromptLoader, RLHFDataset, load_tokenizer


@pytest.fixture(scope="module")
def tokenizer(tiny_model_path):
    return load_tokenizer(tiny_model_path)


def _write(path, n, long_every=0):
    rows = []
    for i in range(n):
        content = f"question {i}" + (" word" * 200 if long_every and i % long_every == 0 else "")
        rows.append({"prompt": [{"role": "system", "content": "be brief"}, {"role": "user", "content": content}],
                     "answer": str(i), "extra_info": {"index": i, "tags": ["a", str(i)]}})
    pq.write_table(pa.Table.from_pylist(rows), path)
    return str(path)


def test_tokenizer_pads_left(tokenizer):
    assert tokenizer.padding_side == "left"
    assert tokenizer.pad_token_id is not None


def test_left_padding_matches_chat_template(tokenizer, tmp_path):
    ds = RLHFDataset(_write(tmp_path / "d.parquet", 6), tokenizer, max_prompt_length=48)
    batch = ds.collate([0, 5])
    ids, mask, pos = batch.batch["input_ids"], batch.batch["attention_mask"], batch.batch["position_ids"]
    assert ids.shape == (2, 48)
    for row, index in enumerate([0, 5]):
        messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": f"question {index}"}]
        expected = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                 return_dict=False)
        n = len(expected)
        assert ids[row, -n:].tolist() == expected
        assert (ids[row, :-n] == tokenizer.pad_token_id).all()
        assert mask[row].tolist() == [0] * (48 - n) + [1] * n
        assert pos[row, -n:].tolist() == list(range(n))
        assert (pos[row, :-n] == 0).all()


def test_other_columns_go_to_non_tensor_batch_aligned(tokenizer, tmp_path):
    ds = RLHFDataset(_write(tmp_path / "d.parquet", 6), tokenizer, max_prompt_length=48)
    batch = ds.collate([4, 1, 3])
    assert set(batch.non_tensor_batch) == {"answer", "extra_info", "raw_prompt"}
    assert list(batch.non_tensor_batch["answer"]) == ["4", "1", "3"]
    assert batch.non_tensor_batch["extra_info"][0] == {"index": 4, "tags": ["a", "4"]}
    assert batch.non_tensor_batch["raw_prompt"][2][1]["content"] == "question 3"
    assert batch.meta_info == {}


def test_overlong_prompt_is_an_error_naming_file_and_row(tokenizer, tmp_path):
    path = _write(tmp_path / "long.parquet", 6, long_every=4)
    with pytest.raises(ValueError, match=r"long\.parquet row 0: the prompt has \d+ tokens > data\.max_prompt_length=48"):
        RLHFDataset(path, tokenizer, max_prompt_length=48)


def test_overlong_prompts_filtered_with_count(tokenizer, tmp_path):
    ds = RLHFDataset(_write(tmp_path / "long.parquet", 6, long_every=4), tokenizer, max_prompt_length=48,
                     filter_overlong_prompts=True)
    assert ds.num_filtered == 2 and len(ds) == 4
    assert [row["answer"] for row in ds.rows] == ["1", "2", "3", "5"]


def test_overlong_prompts_truncated_left_keep_the_end(tokenizer, tmp_path):
    ds = RLHFDataset(_write(tmp_path / "long.parquet", 2, long_every=1), tokenizer, max_prompt_length=16,
                     truncation="left")
    batch = ds.collate([0])
    assert batch.batch["attention_mask"].sum().item() == 16
    assert tokenizer.decode(batch.batch["input_ids"][0]).endswith("<|im_start|>assistant\n")


def test_bad_prompt_column_is_named(tokenizer, tmp_path):
    path = tmp_path / "bad.parquet"
    pq.write_table(pa.Table.from_pylist([{"question": "hi"}]), path)
    with pytest.raises(ValueError, match=r"no column 'prompt'"):
        RLHFDataset(str(path), tokenizer)
    pq.write_table(pa.Table.from_pylist([{"prompt": "just text"}]), path)
    with pytest.raises(ValueError, match=r"bad\.parquet row 0: the prompt must be a non-empty list of chat messages"):
        RLHFDataset(str(path), tokenizer)


def _answers(batch):
    return list(batch.non_tensor_batch["answer"])


def test_loader_resume_is_exact_across_epochs(tokenizer, tmp_path):
    ds = RLHFDataset(_write(tmp_path / "d.parquet", 10), tokenizer, max_prompt_length=48)

    def run(loader, steps):
        seen = []
        while len(seen) < steps:
            for batch in loader:
                seen.append(_answers(batch))
                if len(seen) == steps:
                    break
        return seen

    reference = run(PromptLoader(ds, 3, shuffle=True, seed=7), 8)  # 3 batches per epoch, so 8 spans 3 epochs
    first = PromptLoader(ds, 3, shuffle=True, seed=7)
    head = run(first, 4)
    state = first.state_dict()
    assert (state["epoch"], state["batch_index"]) == (1, 1)
    resumed = PromptLoader(ds, 3, shuffle=True, seed=7)
    resumed.load_state_dict(state)
    tail = run(resumed, 4)
    assert head + tail == reference
    assert reference[0] != reference[3], "epochs must use different permutations"
    assert sorted(sum(reference[:3], [])) != sorted(map(str, range(10)))  # drop_last skips one row per epoch
    assert len(set(sum(reference[:3], []))) == 9


def test_loader_resume_rejects_changed_data(tokenizer, tmp_path):
    ds = RLHFDataset(_write(tmp_path / "d.parquet", 10), tokenizer, max_prompt_length=48)
    state = PromptLoader(ds, 3, seed=7).state_dict()
    smaller = RLHFDataset(_write(tmp_path / "e.parquet", 9), tokenizer, max_prompt_length=48)
    with pytest.raises(ValueError, match=r"num_samples was 10 in the checkpoint but is 9 now"):
        PromptLoader(smaller, 3, seed=7).load_state_dict(state)


def test_unshuffled_validation_loader_keeps_last_partial_batch(tokenizer, tmp_path):
    ds = RLHFDataset(_write(tmp_path / "d.parquet", 5), tokenizer, max_prompt_length=48)
    loader = PromptLoader(ds, 2, shuffle=False, drop_last=False)
    assert [_answers(b) for b in loader] == [["0", "1"], ["2", "3"], ["4"]]
    assert len(loader) == 3 and loader.epoch == 1
