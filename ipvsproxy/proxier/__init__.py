"""The one sync proxier: changed Services in, IPVS table and firewall rules out.

`diff`, `run --once` and the agent all use `Proxier` and differ only in what they do with a
plan: `diff` renders it, `run --once` applies one full pass, the agent (agent_loop.py) runs
passes in a loop.

A pass is full or partial:
- **full** (the first, every `--sync-period`, after the node changed): the kernel is observed
  (IPVS table, addresses, the fallback's chains, the firewall's sets and chains), the whole
  desired state is planned against it, and drift is repaired;
- **partial** (on a change, between full ones): only the virtual servers of the Services that
  changed (plus those with endpoints draining or ramping up, and those whose last operation
  failed) are planned, against the table as last observed and since changed by what this
  proxier applied (`KnownTable`). Nothing is read from the kernel but the draining servers'
  connection counts, so a partial pass costs what changed, not what exists.

A pass is made of steps, each with its own state: the desired state (desired_step.py), the
IPVS table (ipvs_step.py), the firewall (firewall_step.py); passes.py composes them in their
safe order. The values they hand each other are in pass_plan.py; what a pass leaves for other
threads to read (`status`) is a `Snapshot` (snapshot.py).

Imports: firewall, sync.*, kernel, model, policy, config, api, errors.
"""

from ipvsproxy.proxier.ipvs_step import KnownTable
from ipvsproxy.proxier.pass_plan import PassPlan, PassResult, touched
from ipvsproxy.proxier.passes import Proxier
from ipvsproxy.proxier.snapshot import Snapshot, snapshot_of

__all__ = ["KnownTable", "PassPlan", "PassResult", "Proxier", "Snapshot", "snapshot_of", "touched"]
