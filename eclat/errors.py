"""Errors a user of eclat can catch, each naming what went wrong."""

from __future__ import annotations


class EclatError(Exception):
    """Base class of eclat's own errors."""


class UnsupportedOpError(EclatError):
    """A model uses an operation eclat cannot lower."""

    def __init__(self, op: str, source: str | None = None, detail: str = ""):
        self.op, self.source, self.detail = op, source, detail
        where = f" (from {source})" if source else ""
        extra = f": {detail}" if detail else ""
        super().__init__(f"eclat cannot lower {op}{where}{extra}")


class ExportError(EclatError):
    """torch.export rejected the model; carries torch's own reason."""


class ArtifactError(EclatError):
    """An artifact cannot be read or run here; the message names the file and the reason."""
