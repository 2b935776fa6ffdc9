"""The one seam between memprof and torch's internals: the only code that patches or wraps torch.

- `patch`: the one patch/undo helper (`Patches`) and the declared list of every attribute memprof
  ever replaces (`TARGETS`);
- `partition`: the one partitioner chain (Inductor's `custom_partitioner_fn`, every other
  backend's `partition_fn`), where the plan recorder observes and the remat pass transforms;
- `partitioner`: inside the min-cut partitioner, for the remat pass (its saved-set choice);
- `inductor`: code generation and Inductor's own estimates, observed;
- `plan_recorder`: what the compile hooks record (plans, compiled graphs, known tensors);
- `runtime`: a capture's run-time hooks (kernel scopes, torch.profiler, optimizer steps, the
  garbage collector, child processes, Dynamo's recompile limit);
- `graph_breaks`: where Dynamo broke graphs during a capture, read from its own record;
- `predict`: what `memprof sweep --predict` changes (lazy kernels, op-by-op graphs, shared stages);
- `budget`: the one place memprof sets the activation memory budget (functorch's config);
- `fx`: reading FX nodes without changing them (sizes never add a guard).

Nothing here adds a guard or specializes a shape.
"""
