"""Instruction data: prompt/completion and chat records become one sample each, their prompt marked in the token cache,
and --mask-prompt leaves exactly the prompt's targets out of the loss and out of the global count."""
import dataclasses
import json
import random
import shutil

import numpy as np
import pytest

from common.data.instructions import has_chat_template
from common.data.sequences import SequenceView, truncated_records
from common.data.tokencache import TokenCache, prepare_tokens
from common.data.tokenizer import load_tokenizer
from common.errors import UserError
from helpers import FAST, SHARED_DATA, dpcompare_here

GPT2 = SHARED_DATA / "gpt2"
# A template in the shape of the usual ones: a role header, the content, an end of turn; and a generation prompt.
TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{{ eos_token }}\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")


@pytest.fixture(scope="module")
def gpt2():
    if not GPT2.exists():
        pytest.skip(f"the GPT-2 tokenizer folder is not there: {GPT2}")
    return GPT2


@pytest.fixture(scope="module")
def info(gpt2, tmp_path_factory):
    """GPT-2's tokenizer, loaded once: prepare_tokens takes it as it takes a name."""
    return load_tokenizer(str(gpt2), cache_dir=tmp_path_factory.mktemp("tokenizer"))


def write_jsonl(path, records) -> str:
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in records) + "\n")
    return str(path)


def with_template(gpt2, folder, template=TEMPLATE):
    shutil.copytree(gpt2, folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": template}))
    return folder


def samples(cache):
    """Each record's tokens and prompt mask, from the reopened cache."""
    split = TokenCache.open(cache.path).split("train")
    return [(np.asarray(split.tokens[a:b]).tolist(), np.asarray(split.prompt_mask[a:b]).tolist())
            for a, b in zip(split.offsets[:-1], split.offsets[1:])]


PAIRS = [{"prompt": "Q: what is two and two?\nA:", "completion": " four"},
         {"prompt": "", "completion": "A completion with no prompt."},
         {"prompt": "Name a colour.", "completion": " Red, like a ball."}]


def test_prompt_completion_records_mark_their_prompt_and_not_the_completion_or_eos(info, tmp_path):
    cache = prepare_tokens(write_jsonl(tmp_path / "pairs.jsonl", PAIRS), info, cache_dir=tmp_path,
                           val_fraction=0, progress=False)
    expected = []
    for record in PAIRS:
        prompt, completion = info.encode_batch([record["prompt"], record["completion"]])
        expected.append(([*prompt, *completion, info.eos_id], [1] * len(prompt) + [0] * (len(completion) + 1)))
    assert samples(cache) == expected
    assert cache.meta["instruction"]["kinds"] == ["prompt/completion"]
    assert cache.meta["instruction"]["prompt_tokens"] == sum(sum(mask) for _, mask in expected)


def test_a_tokenizer_that_adds_bos_puts_it_in_the_prompt(info, tmp_path):
    with_bos = dataclasses.replace(info, bos_id=info.eos_id - 1)
    cache = prepare_tokens(write_jsonl(tmp_path / "pairs.jsonl", PAIRS[:1]), with_bos, cache_dir=tmp_path,
                           val_fraction=0, progress=False)
    (tokens, mask), = samples(cache)
    prompt = info.encode_batch([PAIRS[0]["prompt"]])[0]
    assert tokens[0] == with_bos.bos_id and mask == [1] * (1 + len(prompt)) + [0] * (len(tokens) - 1 - len(prompt))


CONVERSATION = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "And?"},
                {"role": "assistant", "content": "Bye."}]


@pytest.fixture(scope="module")
def chat(gpt2, tmp_path_factory):
    """(folder, data, cache) of one chat record under a tokenizer folder with TEMPLATE: transformers renders it
    (its import is most of this file's time, shared with the other unit tests that import it)."""
    root = tmp_path_factory.mktemp("chat")
    folder = with_template(gpt2, root / "tokenizer")
    data = write_jsonl(root / "chat.jsonl", [{"messages": CONVERSATION}])
    return folder, data, prepare_tokens(data, str(folder), cache_dir=root, val_fraction=0, progress=False)


def test_chat_records_render_with_the_folders_template_and_mark_all_before_the_last_answer(chat, info):
    _, _, cache = chat
    prompt = ("<|system|>Be brief.<|endoftext|>\n<|user|>Hi<|endoftext|>\n<|assistant|>Hello.<|endoftext|>\n"
              "<|user|>And?<|endoftext|>\n<|assistant|>")  # what apply_chat_template renders of messages[:-1]
    whole = prompt + "Bye.<|endoftext|>\n"
    (tokens, mask), = samples(cache)
    prompt_ids = info.encode_batch([prompt])[0]
    assert tokens == info.encode_batch([whole])[0]  # the template's own end of turn, no EOS added
    assert mask == [1] * len(prompt_ids) + [0] * (len(tokens) - len(prompt_ids))
    assert info.decode(tokens[len(prompt_ids):]) == "Bye.<|endoftext|>\n"
    assert cache.meta["instruction"]["kinds"] == ["chat"]


def test_prompt_completion_records_go_through_the_folders_template_as_mlx_lm_renders_them(chat, info, tmp_path):
    """mlx-lm's CompletionsDataset renders a pair as a user turn and the assistant's; so does the cache, where the
    tokenizer folder has a template (without one, the pair is concatenated: the test above)."""
    folder, _, _ = chat
    cache = prepare_tokens(write_jsonl(tmp_path / "pairs.jsonl", PAIRS[2:]), str(folder), cache_dir=tmp_path,
                           val_fraction=0, progress=False)
    prompt = "<|user|>Name a colour.<|endoftext|>\n<|assistant|>"
    (tokens, mask), = samples(cache)
    prompt_ids = info.encode_batch([prompt])[0]
    assert tokens == info.encode_batch([prompt + " Red, like a ball.<|endoftext|>\n"])[0]
    assert mask == [1] * len(prompt_ids) + [0] * (len(tokens) - len(prompt_ids))
    assert cache.meta["instruction"]["kinds"] == ["prompt/completion"]


def test_a_new_chat_template_builds_a_new_cache_and_the_same_one_reuses_it(chat, tmp_path):
    folder, data, cache = chat
    same, edited = shutil.copytree(folder, tmp_path / "same"), shutil.copytree(folder, tmp_path / "edited")
    assert prepare_tokens(data, str(same), cache_dir=cache.path.parents[1], val_fraction=0,
                          progress=False).path == cache.path  # the template's files name it, not their folder
    config = json.loads((edited / "tokenizer_config.json").read_text())
    config["chat_template"] = TEMPLATE.replace("<|{{ m['role'] }}|>", "[{{ m['role'] }}] ")
    (edited / "tokenizer_config.json").write_text(json.dumps(config))
    rebuilt = prepare_tokens(data, str(edited), cache_dir=cache.path.parents[1], val_fraction=0, progress=False)
    assert rebuilt.path != cache.path and samples(rebuilt)[0][0] != samples(cache)[0][0]


@pytest.fixture(scope="module")
def records(info, tmp_path_factory):
    """Prompts and completions from a few to a hundred tokens: at seq_len 24, prompts that fill the window, records
    cut inside their completion and whole ones all occur."""
    rng = random.Random(0)
    words = "the cat sat on a mat and then a dog ran to the park with a red ball".split()

    def text(n):
        return " ".join(rng.choice(words) for _ in range(n))

    rows = [{"prompt": text(rng.choice((0, 2, 5, 12, 30))), "completion": " " + text(rng.choice((1, 3, 8, 40)))}
            for _ in range(60)]
    folder = tmp_path_factory.mktemp("records")
    cache = prepare_tokens(write_jsonl(folder / "rows.jsonl", rows), info, cache_dir=folder, val_fraction=0,
                           progress=False)
    return cache


@pytest.mark.parametrize("mask_prompt", [False, True])
def test_real_target_count_equals_the_mask_sum_for_any_index_set(records, mask_prompt):
    view = SequenceView(records.split("train"), 24, "padding", mask_prompt=mask_prompt)
    rng = np.random.default_rng(0)
    for _ in range(30):
        step = rng.choice(view.num_samples, size=8, replace=bool(rng.integers(2)))
        assert view.real_target_count(step) == int(view.batch(step)[2].sum())
        # what 4 ranks count of their quarters adds up to what one rank counts of the whole
        assert sum(view.real_target_count(part) for part in np.split(step, 4)) == view.real_target_count(step)


def test_masking_keeps_exactly_the_completion_targets(records):
    split = records.split("train")
    plain, masked = SequenceView(split, 24, "padding"), SequenceView(split, 24, "padding", mask_prompt=True)
    everything = np.arange(plain.num_samples)
    inputs, targets, mask = masked.batch(everything)
    assert np.array_equal(inputs, plain.batch(everything)[0]) and np.array_equal(targets, plain.batch(everything)[1])
    for row, (start, stop) in enumerate(zip(split.offsets[:-1], split.offsets[1:])):
        length = min(stop - start, 25)
        prompt = np.asarray(split.prompt_mask[start + 1:start + length]) == 1  # each target is token j + 1
        assert mask[row].tolist() == [0.0 if p else 1.0 for p in prompt] + [0.0] * (24 - len(prompt))
    assert 0 < mask.sum() < plain.batch(everything)[2].sum()


def test_records_are_one_sample_each_even_when_packing_and_the_cut_ones_are_counted(records):
    split = records.split("train")
    view = SequenceView(split, 24, "packing")
    assert view.mode == "padding" and view.num_samples == split.num_documents == 60
    longer = int(np.count_nonzero(np.diff(np.asarray(split.offsets)) > 25))
    assert 0 < longer < 60 and view.truncated_records == longer
    assert truncated_records(records.path, 24, "packing") == longer  # summary.json's figure
    assert truncated_records(records.path, 1000, "padding") == 0
    assert truncated_records(None, 24, "padding") is None


def test_the_cache_keeps_the_mask_across_reopen_and_refuses_a_cut_mask_file(records, tmp_path):
    copy = tmp_path / "cache"
    shutil.copytree(records.path, copy)
    reopened = TokenCache.open(copy).split("train")
    assert np.array_equal(reopened.prompt_mask, records.split("train").prompt_mask)
    mask_file = copy / records.meta["splits"]["train"]["prompt_mask_file"]
    mask_file.write_bytes(mask_file.read_bytes()[:-1])
    with pytest.raises(UserError, match="train.mask holds .* bytes"):
        TokenCache.open(copy)


def test_mask_prompt_on_plain_text_is_refused(info, tmp_path):
    data = write_jsonl(tmp_path / "text.jsonl", [{"text": "a plain story"}, {"text": "another one"}])
    split = prepare_tokens(data, info, cache_dir=tmp_path, val_fraction=0, progress=False).split("train")
    assert split.prompt_mask is None
    with pytest.raises(UserError, match="--mask-prompt needs instruction data"):
        SequenceView(split, 16, "padding", mask_prompt=True)


CHAT = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]}
BAD = [
    ("not JSON", [PAIRS[0], PAIRS[1], '{"prompt": "x", "completion": '], r"line 3 is not JSON"),
    ("not an object", [PAIRS[0], "[1, 2]"], r"line 2 is not a JSON object"),
    ("missing completion", [PAIRS[0], {"prompt": "only a prompt"}], r"line 2: a prompt/completion record without "
                                                                    r"'completion'"),
    ("empty completion", [PAIRS[0], PAIRS[1], {"prompt": "x", "completion": ""}], r"line 3: the completion is empty"),
    ("chat after pairs", [PAIRS[0], CHAT], r"line 2 is a chat record, but the file's first record is a "
                                           r"prompt/completion one"),
    ("text after pairs", [PAIRS[0], {"text": "story"}], r"line 2 is a text record"),
    ("pairs after text", [{"text": "story"}, {"text": "more"}, PAIRS[0]], r"line 3 is a prompt/completion record, "
                                                                          r"but the file's first record is a text one"),
    ("none of the fields", [PAIRS[0], {"question": "?"}], r"line 2 is a record with none of 'text', "
                                                          r"'prompt'/'completion', 'messages' \(it has: question\)"),
    ("empty messages", [CHAT, {"messages": []}], r"line 2: 'messages' must be a non-empty list"),
    ("last message a user's", [CHAT, {"messages": [{"role": "user", "content": "Hi"}]}],
     r"line 2: the last message is the 'user''s"),
    ("empty answer", [CHAT, {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": ""}]}],
     r"line 2: the completion \(the last message's content\) is empty"),
    ("chat without a template", [CHAT], r"line 1 is a chat record, and tokenizer '.*gpt2' has no chat template"),
]


@pytest.mark.parametrize("lines, message", [case[1:] for case in BAD], ids=[case[0] for case in BAD])
def test_bad_records_are_refused_naming_their_line(info, tmp_path, lines, message):
    data = write_jsonl(tmp_path / "bad.jsonl", lines)
    with pytest.raises(UserError, match=message):
        prepare_tokens(data, info, cache_dir=tmp_path, val_fraction=0, progress=False)
    assert not list(tmp_path.glob("tokens/*"))  # nothing published, nothing half-built left


@pytest.mark.parametrize("dataset, extra, message", [
    ("bad.jsonl", [], "bad.jsonl' line 2: a prompt/completion record without 'completion'"),
    ("text.jsonl", ["--mask-prompt"], "--mask-prompt needs instruction data"),
    ("builtin", ["--mask-prompt"], "--mask-prompt needs instruction data"),
])
def test_the_cli_refuses_bad_instruction_data_in_one_line_before_any_rank(gpt2, tmp_path, dataset, extra, message):
    write_jsonl(tmp_path / "bad.jsonl", [PAIRS[0], {"prompt": "only a prompt"}])
    write_jsonl(tmp_path / "text.jsonl", [{"text": f"story {i}"} for i in range(20)])
    path = dataset if dataset == "builtin" else tmp_path / dataset
    proc = dpcompare_here("run", "--framework", "mlx", *FAST, "--steps", "2", "--dataset", path,
                          "--tokenizer", gpt2, "--out", tmp_path / "run", *extra, cache_dir=tmp_path / "cache")
    assert proc.returncode == 2 and message in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc
    assert not (tmp_path / "run").exists()


def test_has_chat_template_reads_the_config_and_the_jinja_file(gpt2, tmp_path):
    assert not has_chat_template(gpt2)
    assert has_chat_template(with_template(gpt2, tmp_path / "config"))
    plain = tmp_path / "jinja"
    shutil.copytree(gpt2, plain)
    (plain / "chat_template.jinja").write_text(TEMPLATE)
    assert has_chat_template(plain)
