"""Frontend: torch.nn.Module -> primitive IR Graph (torch.export, core ATen, one lowering table).

    graph = lower(model, example_inputs, dynamic_shapes=None)

What the graph holds:
- inputs: one Input node per tensor user input, in order, named after torch.export's
  placeholder (the forward argument's name); symbolic sizes where dynamic_shapes asked.
- weights: parameters, buffers and lifted constants by fully qualified name (tied
  parameters once, under the first name); constants the frontend makes (adaptive pooling
  masks, average-pooling divisors) are named "_frontend_const<k>".
- outputs: the flattened user outputs; graph.out_spec rebuilds their structure with
  torch.utils._pytree.tree_unflatten. Python numbers returned become 0-dim constants.

Shapes of the lowering that later stages recognise: a matmul a[..., M, K] @ b[..., K, N]
is Sum over the last axis of Mul(expand a -> [..., M, N, K], expand b -> [..., M, N, K]);
a convolution is Mul of a strided window view of the (padded, materialised) input and
the expanded weights, summed over kernel positions then input channels.
"""

from .lower import lower

__all__ = ["lower"]
