"""Reading a request's ``TYPE_STRING`` rows as UTF-8 texts, with the errors a user can act on."""

from __future__ import annotations

import numpy as np

from coalesce.core.errors import InvalidInputError


def read_texts(array: np.ndarray | None, name: str, *, max_bytes: int) -> list[str]:
    """The texts of input ``name`` (shape ``[N, 1]``, BYTES), each valid UTF-8 and at most ``max_bytes`` long.

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
            text = value
            size = len(value.encode("utf-8", errors="surrogatepass"))
        elif isinstance(value, bytes | bytearray | np.bytes_):
            size = len(value)
            try:
                text = bytes(value).decode("utf-8")
            except UnicodeDecodeError as exc:
                raise InvalidInputError(
                    f"input '{name}' row {row} is not valid UTF-8: byte 0x{value[exc.start]:02x} "
                    f"at offset {exc.start} ({exc.reason})") from None
        else:
            raise InvalidInputError(f"input '{name}' row {row} is a {type(value).__name__}, expected bytes")
        if size > max_bytes:
            raise InvalidInputError(
                f"input '{name}' row {row} is {size} bytes, over the model's limit of {max_bytes} "
                "(parameter 'max_text_bytes')")
        texts.append(text)
    return texts
