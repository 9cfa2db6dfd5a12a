"""User-facing errors: one clear line, non-zero exit, no traceback (see __main__)."""


class UserError(Exception):
    """A problem with the user's input (config, paths, data). Printed as one line."""


class ArtifactError(UserError):
    """An artifact on disk that cannot be used (unknown version, geometry mismatch, corrupt)."""


def cause(e: BaseException, width: int = 160) -> str:
    """An exception as one short line for a UserError: "TypeName: its first line" (cut to `width` characters)."""
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0][:width]}" if text else type(e).__name__
