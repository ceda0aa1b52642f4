"""Frontend: torch.nn.Module -> primitive IR Graph (torch.export, core ATen, one lowering table)."""

from .lower import lower

__all__ = ["lower"]
