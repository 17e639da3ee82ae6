"""The planner: per tag keep on device, offload to host, or recompute, to minimise the estimated step
time within an HBM budget.

The cost model (per device, per step; every number it uses is printed in the estimates table):

- compute: the step's training FLOPs (`zoo.counts.flops_per_token`) at the device's rate,
  `hardware.matmul_flops * hardware.step_efficiency` for a measured profile, else
  `hardware.peak_flops * plan.flops_efficiency`; where the profile measured rates per op and shape
  (`hardware.op_rates`: attention, the experts' grouped matmul, matmuls by width), each tag's producer
  runs at its measured rate times `step_efficiency` instead (`OpSlowness`: its FLOPs weighted by
  the matmul rate over its op's), at the widths one device computes (`per_device_widths`).
- memory-bound work (norms, RoPE, an MoE's routing, casts: what no op's FLOPs count), where the
  profile prices it: `hardware.activation_passes` passes over the layers' activations (every tag and
  what `none` keeps besides) at `hardware.hbm_gbps`, part of compute; and for a policy that
  checkpoints `hardware.recompute_passes` more (its layers' forward runs again in the backward),
  part of recompute, whatever the tags' assignment (`Problem.memory_s`, `Problem.rerun_s`).
- `remat` of a tag costs its producer's FLOPs (the matmul, attention or norm that makes it; formulas
  in `producer_flops`, ops in `producer_op`; a data-parallel rank's, shared by the devices its batch
  is not split over: tensor and context parallelism) once more per layer, at the same rate (the forward's
  where `op_rates` measured the forward alone), times `hardware.recompute_cost` (the share of a
  recompute the step pays for; fitted on the chip). Nothing else changes.
- `offload` of a tag costs its bytes over the host link, device->host in the layer's forward and
  host->device in its backward, plus a fixed latency per transfer (`plan.transfer_latency_us`: tiny
  tensors gain nothing). The link is full duplex, `link` GB/s each way, unless the profile says it is
  not (`hardware.host_link_duplex`: then the two directions add up). Each layer's offloaded tags
  overlap `hardware.transfer_overlap` of the layer's compute (forward: its forward FLOPs; backward:
  twice those plus what it recomputes; `bench/tpu.py --fit` fits the share from a record's runs), the
  rest exposed; the last layer's transfers are exposed whole, both ways, as the forward turns into
  the backward there with none of that layer's compute left to hide them (`plan.transfers=measured`,
  the default). A profile that measured no share prices every transfer exposed whole, both ways,
  as does `plan.transfers=exposed`; `overlapped` hides every transfer up to its layer's compute (the
  optimistic bound, for a link nobody measured). The layer input's (what the layer's backward starts
  from) is exposed whole, both ways, whatever the profile says (measured on a TPU v5e). The plan
  prints which figures were measured and which assumed (`figures measured: ...; assumed: ...`).
- `device` costs HBM: the tag's bytes per layer times the layers; `offload` one layer's worth, the
  next layer's copy in flight while this one's backward runs. A tag's bytes are one device's:
  its traced array's logical axes (`zoo.tags.TagInfo.axes`) under the run's sharding rules
  (`per_device_shape`: tensor parallelism splits the heads and the MLP hidden dim, sequence
  parallelism the kept layer input).
- HBM is the larger of two phases: forward/backward (parameters on device, gradients, optimizer
  state if on device, the kept tags, untagged residuals and a working set: one layer's
  intermediates, the gradients of its largest block and one layer's attention transient, or the
  head + loss, whichever is larger;
  `attention_working_bytes` by the implementation the planned hardware runs,
  `loss_working_bytes` by `trainer.loss_chunk_size`) and the optimizer update (all state on device;
  with state on host the update streams layer by layer, zoo.train.update: the device-resident
  state, with parameters on host the gradients outside the stacks, and two layers' worth of
  host-resident slices).
- Parameters in host memory move one layer at a time inside the scan (forward and backward, hidden
  behind compute like offloaded tags), their gradients stay on host; host-resident state moves in
  and out for the update, exposed.
- Host memory (pinned, per device) is the offloaded tags (their bytes per layer times the layers, for
  one microbatch: the microbatches run one after another and each one's backward frees what its
  forward offloaded), the host-resident parameters and the stacks' gradients (plus one microbatch's
  gradients arriving to be summed in, with several microbatches), the host-resident optimizer state,
  and the staging of the input: the step's token batch and the next one's, built a step ahead. The
  budget is `hardware.host_bytes_per_device` (or `plan.host_budget_gb`); the per-node figure is that
  times the devices sharing a node's memory (`hardware.devices_per_node`).

The search is exhaustive over every assignment of device / offload / remat to the tags that can take
them (3^15 for DeepSeek-V3, vectorised in chunks); ties go to less host traffic, so with a budget to
spare everything stays on device. An assignment must fit both budgets, HBM and host. If nothing
fits, the one-line error names the budget that failed and the smallest of each that would do, and
`holders` / `best_changes` say who holds the memory and which single change frees the most.

With `offload.ranges`, each range's layers count under their preset's actions (`FixedRange`,
`with_ranges`) and the search assigns the tags of the other layers: the plan is the top-level policy
that goes with the ranges; the holders listing counts each range under its preset too.

With `plan.split=true` the search also places every layer itself as a head (layers 0..b-1) and a tail,
each with its own per-tag assignment (`search_split_tags`: exact per split point, over the
assignments no other beats in every per-layer cost), and writes the sides that are no preset as
policy files that `offload.ranges` takes by path.
"""

# The package, one module a concern (each imports only those above it in this list):
#   problem      the problem and its answer: TagCost, StackCost, Problem, Estimate, PlanError, Infeasible
#   options      PlanConfig (the plan.* keys) and the host link they name (LINKS, resolve_link)
#   hardware     HardwareConfig: the hardware profile's schema (conf/hardware/*.yaml), the planner's inputs
#   cost         the cost model (numpy only): evaluate, evaluate_arrays, transfer_s, estimates_table
#   search       the search over every assignment, and the refusal where nothing fits
#   holders      who holds the memory, and the single change that frees the most
#   policies     between offload policies and assignments (offload.ranges, the plan's YAML)
#   split        the split search (plan.split=true)
#   batch        the batch searched with the policy (plan.batch_search=true)
#   pricing      the tags' FLOPs, ops and bytes per device, from the model's blocks and the sharding
#   working_set  the transient bytes: a layer's attention backward, the head + loss
#   traced       the problem built from a train config and its traced step (problem_from_config)
#   oom          the line the trainer prints on an out-of-memory
#   compiled     the candidates compiled by XLA for the target, and timed on it (plan.compile, plan.measure)
# The hardware profile's schema, the planner's inputs, is zoo.hardware (the trainer reads it too, so it
# stands below both). The command line is zoo.tools.plan. Nothing is imported here: the modules that
# trace a step import the trainer.
