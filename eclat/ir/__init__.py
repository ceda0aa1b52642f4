"""The primitive IR: dtypes, symbolic sizes, views, graphs and the reference interpreter."""

from .dtypes import DType
from .graph import OPS, Graph, Node
from .interpreter import run
from .symbolic import Expr, Var, sint
from .view import View

__all__ = ["DType", "Expr", "Graph", "Node", "OPS", "Var", "View", "run", "sint"]
