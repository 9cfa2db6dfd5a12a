"""User-facing errors: one clear line, non-zero exit, no traceback (see __main__)."""


class UserError(Exception):
    """A problem with the user's input (config, paths, data). Printed as one line."""


class ArtifactError(UserError):
    """An artifact on disk that cannot be used (unknown version, geometry mismatch, corrupt)."""
