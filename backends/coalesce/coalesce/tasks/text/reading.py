"""Reading a request's ``TYPE_STRING`` rows as UTF-8 texts, with the errors a user can act on."""

from __future__ import annotations

import numpy as np

from coalesce.core.errors import InvalidInputError


def cut_utf8(data: bytes, limit: int) -> bytes:
    """The longest prefix of ``data`` of at most ``limit`` bytes that ends at a UTF-8 character boundary."""
    if len(data) <= limit:
        return data
    end = limit
    while end > 0 and (data[end] & 0xC0) == 0x80:  # a continuation byte: the character started earlier
        end -= 1
    return data[:end]


def read_texts(array: np.ndarray | None, name: str, *, max_bytes: int, cut_bytes: int = 0) -> list[str]:
    """The texts of input ``name`` (shape ``[N, 1]``, BYTES), each valid UTF-8 and at most ``max_bytes`` long.

    With ``cut_bytes`` a longer text is cut at a UTF-8 boundary after that many bytes
    before it is decoded (its tail is never decoded, checked or tokenised).

    Raises:
        InvalidInputError: Naming the input, and the row and what is wrong with it.
    """
    if array is None:
        raise InvalidInputError(f"request has no input '{name}'")
    if array.ndim != 2 or array.shape[1] != 1:
        raise InvalidInputError(f"input '{name}' has shape {list(array.shape)}, expected [N, 1]")
    if array.dtype != np.object_:
        raise InvalidInputError(f"input '{name}' has dtype {array.dtype}, expected BYTES")
    if array.shape[0] == 0:
        raise InvalidInputError(f"input '{name}' has no rows: send at least one text (shape [N, 1], N >= 1)")
    texts: list[str] = []
    for row, value in enumerate(array[:, 0]):
        if isinstance(value, str):
            data = value.encode("utf-8", errors="surrogatepass")
        elif isinstance(value, bytes | bytearray | np.bytes_):
            data = bytes(value) if not isinstance(value, bytes) else value
        else:
            raise InvalidInputError(f"input '{name}' row {row} is a {type(value).__name__}, expected bytes")
        if len(data) > max_bytes:
            raise InvalidInputError(
                f"input '{name}' row {row} is {len(data)} bytes, over the model's limit of {max_bytes} "
                "(parameter 'max_text_bytes')")
        if cut_bytes and len(data) > cut_bytes:
            data = cut_utf8(data, cut_bytes)
        elif isinstance(value, str):
            texts.append(value)
            continue
        try:
            texts.append(data.decode("utf-8", errors="surrogatepass" if isinstance(value, str) else "strict"))
        except UnicodeDecodeError as exc:
            raise InvalidInputError(
                f"input '{name}' row {row} is not valid UTF-8: byte 0x{data[exc.start]:02x} "
                f"at offset {exc.start} ({exc.reason})") from None
    return texts
