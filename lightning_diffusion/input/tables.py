"""Prompt sets in tables: Parquet (a file, a folder of files or a glob, read by row group) and
Hugging Face datasets (a ``save_to_disk`` folder, or ``hf://datasets/NAME`` from the local hub
cache, read by record batch), as ``TableRecords``: a few numbers a row group in memory.
"""

from __future__ import annotations

import os
from array import array
from bisect import bisect_right
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Optional, Union

from lightning_diffusion.core.records import KeptColumns, Record
from lightning_diffusion.input.records import (
    COLUMN_FIELDS,
    Columns,
    PromptFileError,
    Records,
    _first_missing,
    _json_ready,
    _shown,
    check_record,
)
from lightning_diffusion.input.settings import MAX_PROMPT_CHARS

if TYPE_CHECKING:
    import pyarrow as pa
    import pyarrow.parquet as pq


def _text_type(kind: pa.DataType) -> bool:
    import pyarrow.types as types

    if types.is_dictionary(kind):
        return _text_type(kind.value_type)
    return bool(types.is_string(kind) or types.is_large_string(kind) or types.is_string_view(kind))


def _integer_type(kind: pa.DataType) -> bool:
    import pyarrow.types as types

    return bool(types.is_integer(kind) or (types.is_dictionary(kind) and types.is_integer(kind.value_type)))


def _holds_bytes(kind: pa.DataType) -> bool:
    """Whether a column of this Arrow type holds bytes somewhere (which JSON cannot)."""
    import pyarrow.types as types

    if types.is_binary(kind) or types.is_large_binary(kind) or types.is_fixed_size_binary(kind):
        return True
    if types.is_binary_view(kind):
        return True
    return any(_holds_bytes(kind.field(i).type) for i in range(kind.num_fields))


class TableRecords(Records):
    """Records of Arrow data, read by position: Parquet files by row group, or the Arrow files of a
    Hugging Face dataset (``save_to_disk``) by record batch. Only the columns a record or its
    metadata needs are read (``Columns.wanted``). Every row is checked once at start, a chunk (row
    group, record batch) at a time; then a record is read from its chunk, the last ``KEEP`` chunks
    read kept per process. In memory: a few numbers a chunk (its first record, file and row group
    or byte offset), and the summary's 4 bytes a record.

    A row is named ``file.parquet:row N`` (``N`` from 0 within its file, as pyarrow and pandas
    count) or, in a dataset, ``folder:row N`` (``N`` the dataset's own index, ``dataset[N]``)."""

    KEEP = 4  # chunks kept decoded, per process

    def __init__(self, files: Sequence[Path], where: str, kind: str, base: Path, max_chars: int = MAX_PROMPT_CHARS,
                 columns: Columns = Columns(), rows_by_file: bool = True) -> None:
        super().__init__(max_chars, columns)
        self.files = [str(f) for f in files]
        self.where = where
        self.kind = kind  # "parquet" or "arrow"
        self.rows_by_file = rows_by_file
        self._base = base
        self.file_start = array("q")   # file -> its first record
        self.chunk_start = array("q")  # chunk -> its first record
        self.chunk_file = array("I")   # chunk -> its file
        self.chunk_key = array("q")    # chunk -> its row group, or the byte offset (a stream) or number of its batch
        self.schemas: list[pa.Schema] = []    # file -> its Arrow schema
        self.streams: list[bool] = []   # file -> an Arrow stream (not the random-access file format)
        self.projections: list[list[str]] = []  # file -> the columns read
        self.fields: list[list[tuple[str, str]]] = []  # file -> (record field, its column) of the fields it has
        self.floats: list[bool] = []  # file -> a field's column may hold a NaN or Infinity
        self._total = 0
        self._handles: dict[int, Union[pq.ParquetFile, pa.MemoryMappedFile, pa.ipc.RecordBatchFileReader]] = {}
        self._pid: Optional[int] = None
        self._chunks: OrderedDict[int, Union[pa.Table, pa.RecordBatch]] = OrderedDict()
        for number, path in enumerate(files):
            self.file_start.append(self._total)
            for key, batches in self._scan(number, path):
                first = self._total
                for batch in batches:
                    for row in self._records(number, batch).to_pylist():
                        self._accept_plain(self._total, {k: v for k, v in row.items() if v is not None},
                                           self.floats[number])
                        self._total += 1
                if self._total > first:
                    self.chunk_start.append(first)
                    self.chunk_file.append(number)
                    self.chunk_key.append(key)

    @property
    def base(self) -> Path:
        return self._base

    def source(self, position: int) -> str:
        if not self.rows_by_file:
            return f"{self.where}:row {position}"
        number = bisect_right(self.file_start, position) - 1
        return f"{self.files[number]}:row {position - self.file_start[number]}"

    def _records(self, number: int, batch: Union[pa.Table, pa.RecordBatch]) -> Union[pa.Table, pa.RecordBatch]:
        """A batch of file ``number``'s rows as record fields: its columns renamed (an empty cell
        is an absent field)."""
        import pyarrow as pa

        fields = self.fields[number]
        kind = pa.Table if isinstance(batch, pa.Table) else pa.RecordBatch
        return kind.from_arrays([batch.column(column) for _, column in fields], names=[name for name, _ in fields])

    def _columns(self, path: Path, schema: pa.Schema) -> list[str]:
        """The columns of a file to read, after its schema is checked against ``data.columns``
        (and the record fields it has noted)."""
        import pyarrow.types as types

        names = list(schema.names)
        shape = self.columns
        missing = _first_missing(shape, names)
        if missing:
            raise PromptFileError(f"{path}: {missing}, which is not a column of it (its columns: {_shown(names)}).")
        for kept in shape.keep:
            kind = schema.field(kept).type
            if _holds_bytes(kind):
                raise PromptFileError(f"{path}: column {kept!r} (data.keep_columns) holds {kind}, bytes that an "
                                      "image's metadata (JSON text) cannot carry.")
        prompt = shape.column("prompt")
        if prompt is None or prompt not in names:
            raise PromptFileError(f"{path}: no 'prompt' column (its columns: {_shown(names)}); name the prompt's "
                                  "column with data.columns: {prompt: COLUMN}.")
        for name in ("prompt", "negative_prompt"):
            column = shape.column(name)
            if column in names and not _text_type(schema.field(column).type):
                raise PromptFileError(f"{path}: column {shape.described(name)} holds {schema.field(column).type}, "
                                      f"not text (a {name} is a string).")
        column = shape.column("seed")
        if column in names and not _integer_type(schema.field(column).type):
            raise PromptFileError(f"{path}: column {shape.described('seed')} holds {schema.field(column).type}, not "
                                  "integers (a seed is an integer from 0 to 2**64 - 1).")
        fields = [(name, column) for name in COLUMN_FIELDS
                  if (column := shape.column(name)) is not None and column in names]
        self.fields.append(fields)
        self.floats.append(any(not (types.is_string(t) or types.is_large_string(t) or types.is_integer(t)
                                    or types.is_boolean(t) or types.is_dictionary(t))
                               for t in (schema.field(column).type for _, column in fields)))
        return shape.wanted(names)

    def _scan(self, number: int, path: Path) -> Iterator[tuple[int, Iterator[pa.RecordBatch]]]:
        """Open file ``number`` and check its schema; then each chunk's key and its record batches."""
        import pyarrow as pa

        if self.kind == "parquet":
            import pyarrow.parquet as pq

            try:
                handle = pq.ParquetFile(path)
            except (pa.ArrowException, OSError) as err:
                raise PromptFileError(f"{path}: not a Parquet file ({str(err).splitlines()[0]}).") from None
            self.schemas.append(handle.schema_arrow)
            self.streams.append(False)
            self.projections.append(self._columns(path, handle.schema_arrow))
            for group in range(handle.num_row_groups):
                table = handle.read_row_group(group, columns=self.projections[number])
                yield group, iter(table.to_batches(max_chunksize=4096))
            return
        try:
            source = pa.memory_map(str(path))
            stream = source.read(6) != b"ARROW1"
            source.seek(0)
            reader: Optional[pa.ipc.RecordBatchFileReader] = None if stream else pa.ipc.open_file(source)
            schema = pa.ipc.read_schema(pa.ipc.read_message(source)) if reader is None else reader.schema
        except (pa.ArrowException, OSError, EOFError) as err:
            raise PromptFileError(f"{path}: not an Arrow file of a dataset ({str(err).splitlines()[0]}).") from None
        self.schemas.append(schema)
        self.streams.append(stream)
        self.projections.append(self._columns(path, schema))
        if reader is not None:
            for batch in range(reader.num_record_batches):
                yield batch, iter([reader.get_batch(batch).select(self.projections[number])])
            return
        while True:
            offset = source.tell()
            try:
                message = pa.ipc.read_message(source)
            except EOFError:
                return
            if message.type != "record batch":
                raise PromptFileError(f"{path}: holds an Arrow {message.type} message, which is not read here "
                                      "(save the dataset with datasets' save_to_disk).")
            yield offset, iter([pa.ipc.read_record_batch(message, schema).select(self.projections[number])])

    def _handle(self, number: int) -> Union[pq.ParquetFile, pa.MemoryMappedFile, pa.ipc.RecordBatchFileReader]:
        if self._pid != os.getpid():  # one set of handles per process (DataLoader workers)
            self._handles, self._chunks, self._pid = {}, OrderedDict(), os.getpid()
        if number not in self._handles:
            import pyarrow as pa

            if self.kind == "parquet":
                import pyarrow.parquet as pq

                self._handles[number] = pq.ParquetFile(self.files[number])
            else:
                source = pa.memory_map(self.files[number])
                self._handles[number] = source if self.streams[number] else pa.ipc.open_file(source)
        return self._handles[number]

    def _chunk(self, chunk: int) -> Union[pa.Table, pa.RecordBatch]:
        handle = self._handle(self.chunk_file[chunk])
        if chunk in self._chunks:
            self._chunks.move_to_end(chunk)
            return self._chunks[chunk]
        number, key = self.chunk_file[chunk], self.chunk_key[chunk]
        if self.kind == "parquet":
            data = handle.read_row_group(key, columns=self.projections[number])
        elif self.streams[number]:
            import pyarrow as pa

            handle.seek(key)
            data = pa.ipc.read_record_batch(pa.ipc.read_message(handle), self.schemas[number])
            data = data.select(self.projections[number])
        else:
            data = handle.get_batch(key).select(self.projections[number])
        self._chunks[chunk] = data
        while len(self._chunks) > self.KEEP:
            self._chunks.popitem(last=False)
        return data

    def __len__(self) -> int:
        return self._total

    def __getitem__(self, position):
        if isinstance(position, slice):
            return [self[i] for i in range(*position.indices(len(self)))]
        return self.read(position)[0]

    def read(self, position: int) -> tuple[Record, Optional[KeptColumns]]:
        if position < 0:
            position += self._total
        if not 0 <= position < self._total:
            raise IndexError(f"record {position} of {self._total}")
        chunk = bisect_right(self.chunk_start, position) - 1
        number, row = self.chunk_file[chunk], self._chunk(chunk).slice(position - self.chunk_start[chunk], 1)
        item = {k: v for k, v in self._records(number, row).to_pylist()[0].items() if v is not None}
        kept = None
        if self.columns.keep:
            kept = {k: _json_ready(v) for k, v in row.select(list(self.columns.keep)).to_pylist()[0].items()}
        return check_record(item, self.source(position), self._base, self.floats[number], self.max_chars), kept

    def __getstate__(self) -> dict[str, object]:
        return {**self.__dict__, "_handles": {}, "_chunks": OrderedDict(), "_pid": None}
