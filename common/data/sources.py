"""Where documents come from: the builtin stories, local files and folders, or the Hugging Face hub.

`--dataset` takes one string. It names, in this order:
  "builtin"                     stories from `corpus.generate_stories`, nothing downloaded;
  an existing .txt file         documents separated by `<|endoftext|>` lines if it has any, else by
                                blank lines;
  an existing .json/.jsonl      records (JSON Lines, or one JSON list) whose `text_field` holds the text;
  an existing .parquet          a table with a `text_field` column;
  an existing folder            written by `datasets` `save_to_disk` (a DatasetDict gives `split`), or
                                holding data files of the kinds above (those whose path mentions
                                `split`, when some do);
  anything else                 a hub dataset such as `roneneldan/TinyStories`.
Every document is stripped and empty ones are dropped, whatever the source.

Each source also has an identity: a small dict that changes when the data changes (a content hash for
local data), which the token cache puts into its fingerprint.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from common.data.corpus import CORPUS_VERSION, DEFAULT_CORPUS_BYTES, generate_stories
from common.data.hub import hub_offline_if_unreachable
from common.errors import UserError

TEXT_SUFFIXES = (".txt",)
JSON_SUFFIXES = (".json", ".jsonl")
PARQUET_SUFFIXES = (".parquet",)
DATA_SUFFIXES = TEXT_SUFFIXES + JSON_SUFFIXES + PARQUET_SUFFIXES
# Hub ids are "name" or "owner/name"; anything else that does not exist is a mistyped path.
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?$")
EOS_LINE = re.compile(r"^<\|endoftext\|>[ \t\r]*$", re.MULTILINE)
BLANK_LINE = re.compile(r"\n[ \t\r]*\n")



@dataclass
class Documents:
    documents: list[str] | Iterator[str]  # an iterator only for hub datasets streamed
    identity: dict


def load_documents(dataset: str, *, split: str = "train", text_field: str = "text",
                   streaming: bool = False, builtin_bytes: int = DEFAULT_CORPUS_BYTES,
                   seed: int = 0) -> Documents:
    identity = source_identity(dataset, split=split, text_field=text_field, builtin_bytes=builtin_bytes,
                               seed=seed)
    if identity["kind"] == "builtin":
        texts = generate_stories(builtin_bytes, seed)
    elif identity["kind"] == "hub":
        texts = _hub_texts(dataset, split, text_field, streaming)
        if streaming:
            return Documents(_clean_stream(texts, dataset), identity)
    else:
        texts = _local_texts(Path(dataset).expanduser(), split, text_field)
    documents = _clean(texts)
    if not documents:
        raise UserError(f"dataset {dataset!r} is empty: it holds no documents (no non-empty text"
                        f"{'' if identity['kind'] in ('builtin', 'text') else f' in field {text_field!r}'})")
    return Documents(documents, identity)


def source_identity(dataset: str, *, split: str = "train", text_field: str = "text",
                    builtin_bytes: int = DEFAULT_CORPUS_BYTES, seed: int = 0) -> dict:
    """What the data is, cheaply: no parsing, no download (a local source's bytes are hashed)."""
    if dataset == "builtin":
        if not isinstance(builtin_bytes, int) or builtin_bytes <= 0:
            raise UserError(f"builtin corpus size must be a positive number of bytes, got {builtin_bytes!r}")
        return {"kind": "builtin", "bytes": builtin_bytes, "seed": seed, "corpus_version": CORPUS_VERSION}
    path = Path(dataset).expanduser()
    if path.is_file():
        return {"kind": _file_kind(path), "sha256": _hash_file(path)}
    if path.is_dir():
        files = _saved_dataset_files(path) or _data_files(path, split)
        return {"kind": "folder", "sha256": _hash_files(files, path)}
    if looks_like_path(dataset, DATA_SUFFIXES):
        raise UserError(f"dataset path {dataset!r} does not exist")
    return {"kind": "hub", "name": dataset, "split": split, "text_field": text_field}


def looks_like_path(name: str, suffixes: Iterable[str]) -> bool:
    """True for strings a user meant as a file path rather than a hub id."""
    return (name.startswith((".", "/", "~")) or name.endswith(tuple(suffixes))
            or (os.sep != "/" and os.sep in name) or not HUB_ID.match(name))


# ---- local data ---------------------------------------------------------------------------------


def _file_kind(path: Path) -> str:
    suffix = path.suffix.lower()
    if suffix in TEXT_SUFFIXES:
        return "text"
    if suffix in JSON_SUFFIXES:
        return "json"
    if suffix in PARQUET_SUFFIXES:
        return "parquet"
    raise UserError(f"dataset file {str(path)!r} has an unsupported type {suffix or '(no suffix)'!r}; "
                    f"use one of {', '.join(DATA_SUFFIXES)}")


def _saved_dataset_files(folder: Path) -> list[Path]:
    """All files of a `save_to_disk` folder, or [] when `folder` is not one."""
    if (folder / "dataset_dict.json").is_file() or (folder / "state.json").is_file():
        return sorted(p for p in folder.rglob("*") if p.is_file())
    return []


def _data_files(folder: Path, split: str) -> list[Path]:
    files = sorted(p for p in folder.rglob("*")
                   if p.is_file() and p.suffix.lower() in DATA_SUFFIXES and not p.name.startswith("."))
    if not files:
        raise UserError(f"dataset folder {str(folder)!r} holds no {'/'.join(DATA_SUFFIXES)} files and was "
                        "not written by datasets' save_to_disk")
    # A downloaded dataset repository keeps every split side by side; take the asked one.
    of_split = [p for p in files if split in str(p.relative_to(folder))]
    return of_split or files


def _hash_file(path: Path) -> str:
    """The plain sha256 of the file's bytes, as `sha256sum` prints it."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 23):
            digest.update(chunk)
    return digest.hexdigest()


def _hash_files(files: list[Path], root: Path) -> str:
    """Names and contents: renaming or moving a file inside the folder changes the data too."""
    digest = hashlib.sha256()
    for path in files:
        digest.update(f"{path.relative_to(root)}\0{_hash_file(path)}\0".encode())
    return digest.hexdigest()


def _local_texts(path: Path, split: str, text_field: str) -> list:
    if path.is_file():
        if path.stat().st_size == 0:
            raise UserError(f"dataset file {str(path)!r} is empty")
        return _file_texts(path, text_field)
    if _saved_dataset_files(path):
        return _saved_dataset_texts(path, split, text_field)
    texts = []
    for file in _data_files(path, split):
        texts.extend(_file_texts(file, text_field))
    return texts


def _file_texts(path: Path, text_field: str) -> list:
    kind = _file_kind(path)
    if kind == "text":
        return split_text_documents(_read_text(path))
    if kind == "json":
        return _json_texts(path, text_field)
    return _parquet_texts(path, text_field)


def split_text_documents(text: str) -> list[str]:
    """Documents of a plain-text file: between `<|endoftext|>` lines if there are any, else paragraphs."""
    return EOS_LINE.split(text) if EOS_LINE.search(text) else BLANK_LINE.split(text)


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise UserError(f"dataset file {str(path)!r} is not UTF-8 text (byte {e.start})") from None
    except OSError as e:
        raise UserError(f"cannot read dataset file {str(path)!r}: {e.strerror}") from None


def _json_texts(path: Path, text_field: str) -> list:
    """A .json file is first read as one JSON document, a .jsonl file as JSON Lines; either falls back
    to the other, since both spellings are used for both."""
    import pyarrow as pa
    import pyarrow.json as pa_json

    if path.suffix.lower() == ".json":
        with contextlib.suppress(json.JSONDecodeError):
            return _json_document_texts(json.loads(_read_text(path)), text_field, path)
    try:  # JSON Lines, parsed by Arrow in C++
        table = pa_json.read_json(path)
    except pa.ArrowInvalid:  # not JSON Lines, or rows Arrow cannot give one schema (mixed types, long lines)
        table = None
    if table is not None:
        _refuse_instruction_records(path, table.column_names, text_field)
        return _column_texts(table.column_names, lambda: table.column(text_field).to_pylist(), text_field, path)
    text = _read_text(path)
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        data = []
        for number, line in enumerate(text.splitlines(), 1):
            try:
                data.append(json.loads(line) if line.strip() else None)
            except json.JSONDecodeError as e:
                raise UserError(f"dataset file {str(path)!r} is neither JSON Lines nor JSON (line {number}: "
                                f"{e.msg})") from None
        _refuse_instruction_records(path, {k for row in data if isinstance(row, dict) for k in row}, text_field)
        data = [row for row in data if row is not None]
    return _json_document_texts(data, text_field, path)


def _refuse_instruction_records(path: Path, columns, text_field: str) -> None:
    """A JSON Lines file read as text (its first record is) whose later records are instruction ones: one line
    naming the first of them (common/data/instructions.py reads files of instruction records)."""
    if set(columns) & set(INSTRUCTION_KEYS):
        _first_instruction_line(path, text_field)


def _json_document_texts(data, text_field: str, path: Path) -> list:
    """Texts of parsed JSON: a list of records, one record, or a dict of columns."""
    if isinstance(data, dict) and data and all(isinstance(v, list) for v in data.values()):
        return _column_texts(list(data), lambda: list(data[text_field]), text_field, path)
    if isinstance(data, dict):
        data = [data]
    if isinstance(data, list) and all(isinstance(row, dict) for row in data):
        keys = sorted({key for row in data for key in row})
        return _column_texts(keys, lambda: [row.get(text_field) for row in data], text_field, path)
    raise UserError(f"dataset file {str(path)!r} must hold JSON records (objects), one per line or in a list")


def _parquet_texts(path: Path, text_field: str) -> list:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        names = pq.read_schema(path).names
        return _column_texts(names, lambda: pq.read_table(path, columns=[text_field]).column(text_field)
                             .to_pylist(), text_field, path)
    except (pa.ArrowException, OSError) as e:
        raise UserError(f"cannot read parquet file {str(path)!r}: {e}") from None


def _saved_dataset_texts(folder: Path, split: str, text_field: str) -> list:
    import datasets

    try:
        data = datasets.load_from_disk(str(folder))
    except Exception as e:  # datasets raises several types for a damaged folder
        raise UserError(f"cannot load the saved dataset {str(folder)!r}: {_first_line(e)}") from None
    if isinstance(data, datasets.DatasetDict):
        if split not in data:
            raise UserError(f"saved dataset {str(folder)!r} has no split {split!r}; it has: "
                            f"{', '.join(data)}")
        data = data[split]
    return _column_texts(data.column_names, lambda: _dataset_column(data, text_field), text_field, folder)


def _dataset_column(data, text_field: str) -> list:
    texts = []
    for batch in data.select_columns([text_field]).iter(batch_size=10_000):
        texts.extend(batch[text_field])
    return texts


def _require_field(columns: list[str], text_field: str, where) -> None:
    if text_field not in columns:
        raise UserError(f"dataset {str(where)!r} has no field {text_field!r}; available fields: "
                        f"{', '.join(map(str, columns)) or '(none)'}; choose one with --text-field")


def _column_texts(columns: list[str], read_column, text_field: str, where) -> list:
    """The field's values, read (by `read_column()`) only once the field is known to exist."""
    _require_field(columns, text_field, where)
    values = read_column()
    wrong = next((v for v in values if v is not None and not isinstance(v, str)), None)
    if wrong is not None:
        raise UserError(f"field {text_field!r} of dataset {str(where)!r} holds {type(wrong).__name__} "
                        "values, not text; choose a text field with --text-field")
    return values


def _clean(texts: Iterable) -> list[str]:
    return [doc for doc in (t.strip() for t in texts if t) if doc]


def _clean_stream(texts: Iterator, dataset: str) -> Iterator[str]:
    for text in texts:
        if text is not None and not isinstance(text, str):
            raise UserError(f"dataset {dataset!r} yields {type(text).__name__} values, not text; "
                            "choose a text field with --text-field")
        if text and (doc := text.strip()):
            yield doc


def _first_line(error: BaseException) -> str:
    return (str(error).strip().splitlines() or [type(error).__name__])[0]


# ---- JSON Lines records: text, or instructions (common/data/instructions.py) -------------------


PROMPT_COMPLETION, CHAT, TEXT = "prompt/completion", "chat", "text"
INSTRUCTION_KINDS = (PROMPT_COMPLETION, CHAT)
INSTRUCTION_KEYS = ("prompt", "completion", "messages")


def kind_of(record: dict, text_field: str = "text") -> str | None:
    """mlx-lm's order: prompt and completion, then messages, then text; a lone prompt or completion is a
    prompt/completion record missing its other half."""
    if "prompt" in record and "completion" in record:
        return PROMPT_COMPLETION
    if "messages" in record:
        return CHAT
    if text_field in record:
        return TEXT
    if "prompt" in record or "completion" in record:
        return PROMPT_COMPLETION
    return None


def _first_instruction_line(path: Path, text_field: str) -> None:
    """A file read as text whose records include instruction ones: the one-line error naming the first."""
    for number, (line, record) in enumerate(json_lines(path)):
        kind = kind_of(record, text_field)
        if kind in INSTRUCTION_KINDS and number == 0:
            raise UserError(f"dataset file {str(path)!r} holds {kind} records, not text: prepare a token cache "
                            "from it (common/data/instructions.py reads them)")
        if kind in INSTRUCTION_KINDS:
            raise UserError(f"{where_in_file(path, line)} is a {kind} record, but the file's first record is a "
                            "text one; one kind of record per file")


def json_lines(path: Path) -> Iterable[tuple[int, dict]]:
    """(line number, record) of each non-blank line; a line that is no JSON object is the user's error."""
    with open(path, encoding="utf-8", errors="strict") as f:
        try:
            for line, text in enumerate(f, 1):
                if not text.strip():
                    continue
                try:
                    record = json.loads(text)
                except json.JSONDecodeError as e:
                    raise UserError(f"{where_in_file(path, line)} is not JSON ({e.msg}, column {e.colno})") from None
                if not isinstance(record, dict):
                    raise UserError(f"{where_in_file(path, line)} is not a JSON object (a record), but "
                                    f"{type(record).__name__}")
                yield line, record
        except UnicodeDecodeError as e:
            raise UserError(f"dataset file {str(path)!r} is not UTF-8 text (byte {e.start} of a line)") from None


def where_in_file(path: Path, line: int) -> str:
    return f"dataset file {str(path)!r} line {line}"


# ---- the hub ------------------------------------------------------------------------------------


def _hub_texts(name: str, split: str, text_field: str, streaming: bool):
    import datasets

    with hub_offline_if_unreachable() as reachable:
        try:
            data = datasets.load_dataset(name, split=split, streaming=streaming)
        except Exception as e:  # connection, not-found and bad-split errors come in many types
            if not reachable:
                raise UserError(
                    f"dataset {name!r} is not a local path, the Hugging Face hub is unreachable and it is not "
                    "in the local datasets cache; download it on a connected machine (datasets.load_dataset "
                    "then save_to_disk) and pass that folder, or pass a local .txt/.jsonl/.parquet path"
                ) from None
            raise UserError(f"cannot load dataset {name!r} from the hub: {_first_line(e)}") from None
    if not streaming:
        return _column_texts(data.column_names, lambda: _dataset_column(data, text_field), text_field, name)
    if data.column_names is not None:  # unknown for some streamed datasets until the first row
        _require_field(data.column_names, text_field, name)
    return (row.get(text_field) for row in data)
