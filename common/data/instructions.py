"""Instruction data: JSON Lines records whose prompt is marked token by token, so that `--mask-prompt` can leave
it out of the loss. The forms are those mlx-lm's trainer reads (tuner/datasets.py):

    {"text": ...}                              plain text, read by common/data/sources.py as any document
    {"prompt": ..., "completion": ...}         where the tokenizer folder has a chat template: a user turn and
                                               the assistant's, rendered as a chat record below (mlx-lm's
                                               CompletionsDataset does this); without one, BOS (where the
                                               tokenizer adds one) + the prompt's tokens + the completion's
                                               tokens + EOS, each text tokenized on its own; the BOS and the
                                               prompt are marked
    {"messages": [{"role", "content"}, ...]}   the conversation rendered by the tokenizer folder's chat template
                                               (transformers' apply_chat_template), tokenized as a whole; the
                                               marked prompt is the rendering of messages[:-1] with the
                                               generation prompt, as long as mlx-lm's ChatDataset takes it.
                                               Nothing is added: the template writes its own BOS and end of turn.
                                               The last message is the assistant's, the completion. A record's
                                               "tools", if any, go to the template too.

A file holds one kind, decided by its first record; each record is one training sample (common/data/sequences.py).
Any mistake in a record is the user's, named by its line.
"""
from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from common.data.sources import (CHAT, INSTRUCTION_KINDS, PROMPT_COMPLETION, JSON_SUFFIXES, _data_files,
                                  _saved_dataset_files, json_lines, kind_of, where_in_file as _where)
from common.errors import UserError

# Where transformers (4.43 and later) finds a folder's chat template, besides tokenizer_config.json's
# "chat_template"; special_tokens_map.json gives the template its bos_token and eos_token.
TEMPLATE_FILES = ("tokenizer_config.json", "chat_template.jinja", "chat_template.json", "special_tokens_map.json")


@dataclass(frozen=True)
class Record:
    kind: str
    path: str                      # its file
    line: int                      # 1-based line there
    prompt: str = ""
    completion: str = ""
    messages: tuple = ()
    tools: list | None = None


@dataclass
class Records:
    records: list[Record]
    kinds: list[str]               # the kinds present, sorted


# ---- reading -----------------------------------------------------------------------------------


def load_instructions(dataset: str, *, split: str = "train", text_field: str = "text") -> Records | None:
    """The records of a local JSON Lines dataset (a file, or a folder of them) of instruction records; None where
    the data is plain text (or not JSON Lines), which common/data/sources.py reads."""
    path = Path(dataset).expanduser()
    if path.is_file():
        files = [path] if path.suffix.lower() in JSON_SUFFIXES else []
    elif path.is_dir() and not _saved_dataset_files(path):
        files = _data_files(path, split)
    else:
        return None
    kinds = {file: file_kind(file, text_field) for file in files}
    instruction = [file for file, kind in kinds.items() if kind in INSTRUCTION_KINDS]
    if not instruction:
        return None
    if len(instruction) != len(files):
        other = next(file for file in files if file not in instruction)
        raise UserError(f"dataset folder {str(path)!r} mixes instruction records ({instruction[0].name}) with "
                        f"other data ({other.name}); keep one kind of data per dataset")
    records = [record for file in files for record in read_records(file, str(kinds[file]), text_field)]
    return Records(records, sorted({r.kind for r in records}))


def file_kind(path: Path, text_field: str = "text") -> str | None:
    """The kind of a file's first record; None where its first line is no JSON object (a JSON document, or
    broken: sources.py says which)."""
    with open(path, "rb") as f:
        for raw in f:
            if raw.strip():
                try:
                    first = json.loads(raw)
                except (json.JSONDecodeError, UnicodeDecodeError):
                    return None
                return kind_of(first, text_field) if isinstance(first, dict) else None
    return None


def read_records(path: Path, kind: str, text_field: str = "text") -> list[Record]:
    records = []
    for line, record in json_lines(path):
        found = kind_of(record, text_field)
        if found != kind:
            what = f"a {found} record" if found else \
                f"a record with none of {text_field!r}, 'prompt'/'completion', 'messages' (it has: " \
                f"{', '.join(map(str, record)) or 'nothing'})"
            raise UserError(f"{_where(path, line)} is {what}, but the file's first record is a {kind} one; "
                            "one kind of record per file")
        records.append(_prompt_completion(record, path, line) if kind == PROMPT_COMPLETION
                       else _chat(record, path, line))
    return records


def _prompt_completion(record: dict, path: Path, line: int) -> Record:
    for key in ("prompt", "completion"):
        if key not in record:
            raise UserError(f"{_where(path, line)}: a prompt/completion record without {key!r}")
        if not isinstance(record[key], str):
            raise UserError(f"{_where(path, line)}: {key!r} must be text, not {type(record[key]).__name__}")
    if not record["completion"]:
        raise UserError(f"{_where(path, line)}: the completion is empty (nothing to train on)")
    return Record(PROMPT_COMPLETION, str(path), line, prompt=record["prompt"], completion=record["completion"])


def _chat(record: dict, path: Path, line: int) -> Record:
    messages = record["messages"]
    if not isinstance(messages, list) or not messages:
        raise UserError(f"{_where(path, line)}: 'messages' must be a non-empty list of {{role, content}} objects")
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str) \
                or not isinstance(message.get("content"), (str, list)):
            raise UserError(f"{_where(path, line)}: message {i} is not a {{role, content}} object")
    last = messages[-1]
    if last["role"] != "assistant":
        raise UserError(f"{_where(path, line)}: the last message is the {last['role']!r}'s; the completion is the "
                        "last message, the assistant's")
    if not last["content"]:
        raise UserError(f"{_where(path, line)}: the completion (the last message's content) is empty")
    tools = record.get("tools")
    return Record(CHAT, str(path), line, messages=tuple(messages), tools=tools if isinstance(tools, list) else None)


# ---- the chat template -------------------------------------------------------------------------


def templated_records(records: list[Record], tokenizer) -> list[Record]:
    """The records a chat template renders: chat records, and prompt/completion pairs where the tokenizer folder
    has a template (as mlx-lm renders them); the template is loaded only when there is one."""
    folder = _folder(tokenizer)
    with_template = folder is not None and has_chat_template(folder)
    return [r for r in records if r.kind == CHAT or (with_template and r.kind == PROMPT_COMPLETION)]


def as_chat(record: Record) -> Record:
    """A prompt/completion pair as mlx-lm's CompletionsDataset renders it: the user's turn, then the assistant's."""
    return Record(CHAT, record.path, record.line, tools=record.tools,
                  messages=({"role": "user", "content": record.prompt},
                            {"role": "assistant", "content": record.completion}))


def template_identity(tokenizer) -> str | None:
    """sha256 of the files a tokenizer folder's chat template is read from, None without a template: the token
    cache's fingerprint takes it, so editing the template rebuilds the cache."""
    folder = _folder(tokenizer)
    if folder is None or not has_chat_template(folder):
        return None
    digest = hashlib.sha256()
    for name in TEMPLATE_FILES:
        if (folder / name).is_file():
            digest.update(f"{name}\0".encode() + (folder / name).read_bytes() + b"\0")
    return digest.hexdigest()


def has_chat_template(folder: Path) -> bool:
    if (folder / "chat_template.jinja").is_file() or (folder / "chat_template.json").is_file():
        return True
    try:
        config = json.loads((folder / "tokenizer_config.json").read_text())
    except (OSError, json.JSONDecodeError):
        return False
    return isinstance(config, dict) and bool(config.get("chat_template"))


def _folder(tokenizer) -> Path | None:
    name = tokenizer if isinstance(tokenizer, str) else getattr(tokenizer, "name", "")
    path = Path(name).expanduser()
    return path if name and path.is_dir() else None


class ChatTemplate:
    """A tokenizer folder's chat template, rendered by transformers (loaded on first use: only a token cache
    built from chat records needs it). PreTrainedTokenizerFast renders as AutoTokenizer's class would, from the
    same tokenizer_config.json, without importing torch."""

    def __init__(self, tokenizer, first: Record):
        folder = _folder(tokenizer)
        if folder is None or not has_chat_template(folder):
            raise UserError(f"{_where_record(first)} is a chat record, and tokenizer "
                            f"{getattr(tokenizer, 'name', tokenizer)!r} has no chat template (no chat_template in "
                            "a tokenizer folder's tokenizer_config.json, no chat_template.jinja); pass --tokenizer "
                            "a folder with one")
        if (folder / "tokenizer.json").is_file():
            from transformers import PreTrainedTokenizerFast as loader
        else:  # a slow tokenizer's files: AutoTokenizer's class (its import also imports torch)
            from transformers import AutoTokenizer as loader  # type: ignore[assignment]
        self.folder, self.pretrained = folder, loader.from_pretrained(str(folder))

    def render(self, record: Record) -> tuple[str, str]:
        """(the whole conversation, its prompt: messages[:-1] and the generation prompt)."""
        messages = list(record.messages)
        try:
            whole = self.pretrained.apply_chat_template(messages, tools=record.tools, tokenize=False)
            prompt = self.pretrained.apply_chat_template(messages[:-1], tools=record.tools, tokenize=False,
                                                         add_generation_prompt=True)
        except Exception as e:  # jinja2's TemplateError from raise_exception, TypeError, ValueError...
            first = (str(e).strip().splitlines() or [type(e).__name__])[0]
            raise UserError(f"{_where_record(record)}: the chat template of {str(self.folder)!r} refuses the "
                            f"conversation: {first}") from None
        return str(whole), str(prompt)


def _where_record(record: Record) -> str:
    return _where(Path(record.path), record.line)


# ---- tokens ------------------------------------------------------------------------------------


def encode(records: list[Record], info, template: ChatTemplate | None) -> tuple[list[list[int]], list[int]]:
    """Each record's token ids and how many of its leading tokens are the prompt."""
    if template is not None:  # pairs go through the template too, as mlx-lm renders them
        records = [as_chat(r) if r.kind == PROMPT_COMPLETION else r for r in records]
    tokens: list[list[int]] = []
    prompt_lengths: list[int] = []
    pairs = [r for r in records if r.kind == PROMPT_COMPLETION]
    if pairs:
        prompts = info.encode_batch([r.prompt for r in pairs])
        completions = info.encode_batch([r.completion for r in pairs])
    chats = [r for r in records if r.kind == CHAT]
    if chats:
        if template is None:
            raise UserError(f"{_where_record(chats[0])} is a chat record, and no chat template was loaded")
        rendered = [template.render(r) for r in chats]
        wholes = info.encode_batch([whole for whole, _ in rendered])
        chat_prompts = info.encode_batch([prompt for _, prompt in rendered])
    pair_i = chat_i = 0
    for record in records:
        if record.kind == PROMPT_COMPLETION:
            bos = [] if info.bos_id is None else [info.bos_id]
            prompt, completion = prompts[pair_i], completions[pair_i]
            pair_i += 1
            if not completion:
                raise UserError(f"{_where_record(record)}: the completion has no tokens")
            tokens.append([*bos, *prompt, *completion, info.eos_id])
            prompt_lengths.append(len(bos) + len(prompt))
        else:
            ids, prompt_len = wholes[chat_i], len(chat_prompts[chat_i])
            chat_i += 1
            if prompt_len >= len(ids):
                raise UserError(f"{_where_record(record)}: the chat template renders nothing after the prompt "
                                "(the last message's content is lost)")
            tokens.append(list(ids))
            prompt_lengths.append(prompt_len)
    return tokens, prompt_lengths


def training_texts(records: Iterable[Record]) -> list[str]:
    """What the builtin tokenizer learns from: each prompt/completion record's text."""
    return [r.prompt + r.completion for r in records if r.kind == PROMPT_COMPLETION]
