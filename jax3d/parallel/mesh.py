"""The ('dp', 'pp', 'tp') device mesh; with context parallelism (mesh.cp > 1) ('dp', 'pp', 'cp', 'tp'),
with expert parallelism (mesh.ep > 1) ('dp', 'pp', 'ep', 'tp'), with both ('dp', 'pp', 'ep', 'cp', 'tp').

Placement maps ranks to the topology: `tp` varies fastest, so a tensor-parallel group is a set of
neighbouring devices (one host's NVLink domain), `cp` next (inside a node too), `pp` next, and `dp`
outermost, across hosts. On several hosts `create_hybrid_device_mesh` keeps `tp` inside a host;
with cp, blocks of cp*tp neighbouring devices of one host (`device_grid`). The `cp` axis exists
only when mesh.cp > 1, so a run without it keeps its three-axis mesh; so does `ep` (placed as cp:
ep*tp neighbouring devices of one host, the experts' all-to-all inside a node; with both, ep*cp*tp).
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

from jax3d.config import ConfigError, RunPlan

AXES = ('dp', 'pp', 'tp')
CP_AXES = ('dp', 'pp', 'cp', 'tp')  # mesh.cp > 1
EP_AXES = ('dp', 'pp', 'ep', 'tp')  # mesh.ep > 1
EP_CP_AXES = ('dp', 'pp', 'ep', 'cp', 'tp')  # both


def axes_of(plan: RunPlan) -> tuple[str, ...]:
  """The mesh's axis names: cp and ep only where they are > 1."""
  return {(False, False): AXES, (True, False): CP_AXES, (False, True): EP_AXES, (True, True): EP_CP_AXES}[
    (plan.cp > 1, plan.ep > 1)
  ]


FAKE_CPU_DEVICES = 8


def use_fake_cpu_devices(n: int = FAKE_CPU_DEVICES) -> None:
  """Exposes n fake CPU devices, unless the user set XLA_FLAGS. Call before jax starts its backend.

  The flag only affects the host platform, so on a GPU machine the GPUs stay the default devices.
  """
  if 'XLA_FLAGS' not in os.environ:
    os.environ['XLA_FLAGS'] = f'--xla_force_host_platform_device_count={n}'


def build_mesh(
  plan: RunPlan, devices: Sequence[jax.Device] | None = None, allow_tp_across_hosts: bool = False
) -> Mesh:
  """Mesh(('dp','pp','tp')) of `devices` (default: all) with tp inside hosts, pp next, dp outermost
  (('dp','pp','cp','tp') with mesh.cp > 1: `device_grid`). Axis types are Auto. Raises ConfigError
  when the layout does not fit the devices, or when tp would span hosts without
  `allow_tp_across_hosts`."""
  devices = list(devices if devices is not None else jax.devices())
  grid = device_grid(plan, devices, allow_tp_across_hosts)
  axes = axes_of(plan)
  return Mesh(grid, axes, axis_types=(AxisType.Auto,) * len(axes))


def device_grid(plan: RunPlan, devices: list, allow_tp_across_hosts: bool = False) -> np.ndarray:
  """The devices as the mesh's array, [dp, pp, tp] (or [dp, pp, cp, tp]): placement by
  `process_index` (the host) and `id` alone, the rule of the module docstring."""
  devices = list(devices)
  if len(devices) != plan.n_devices:
    raise ConfigError(
      f'mesh dp*cp*ep*pp*tp = {plan.dp}*{plan.cp}*{plan.ep}*{plan.pp}*{plan.tp} = {plan.n_devices}, '
      f'but {len(devices)} devices are visible'
    )
  n_hosts = len({d.process_index for d in devices})
  per_host = len(devices) // n_hosts
  if plan.cp > 1 or plan.ep > 1:
    return _cp_grid(plan, devices, per_host)
  if n_hosts > 1:
    if plan.tp > per_host or per_host % plan.tp:
      if not allow_tp_across_hosts:
        raise ConfigError(
          f'mesh.tp={plan.tp} would span hosts ({per_host} devices per host): tensor '
          'parallelism needs the fast intra-host links; use tp <= devices per host, or '
          'set --config.mesh.allow_tp_across_hosts=True to force it'
        )
      devices.sort(key=lambda d: (d.process_index, d.id))
      grid = np.array(devices).reshape(plan.dp, plan.pp, plan.tp)
    else:
      from jax.experimental import mesh_utils

      # Inside a host: (1, pp_in, tp); across hosts: (dp, pp_out, 1).
      inner = per_host // plan.tp
      pp_in = np.gcd(plan.pp, inner)
      dp_in = inner // pp_in
      if plan.dp % dp_in:
        raise ConfigError(
          f'mesh dp={plan.dp}, pp={plan.pp}, tp={plan.tp} cannot be placed on {n_hosts} hosts of {per_host} devices'
        )
      # process_is_granule: a host (process) is the unit of the slow network; CPU and most GPU
      # platforms set no slice_index. Devices are sorted so every process lists them alike.
      devices.sort(key=lambda d: (d.process_index, d.id))
      grid = mesh_utils.create_hybrid_device_mesh(
        (dp_in, pp_in, plan.tp),
        (plan.dp // dp_in, plan.pp // pp_in, 1),
        devices=devices,
        process_is_granule=True,
      )
  else:
    devices = sorted(devices, key=lambda d: d.id)
    grid = np.array(devices).reshape(plan.dp, plan.pp, plan.tp)
  return grid


def _cp_grid(plan: RunPlan, devices: list, per_host: int) -> np.ndarray:
  """[dp, pp, cp, tp]: tp innermost, then cp, both inside a host (cp's K/V all-gathers are the
  heaviest traffic after tp's), then pp and dp, across hosts where the hosts' devices run out: the
  devices host by host, in id order, cut into blocks of cp*tp neighbours ([dp, pp, ep, tp] alike,
  and [dp, pp, ep, cp, tp] with both: blocks of ep*cp*tp)."""
  inner = {a: getattr(plan, a) for a in ('ep', 'cp') if getattr(plan, a) > 1}
  name = '*'.join(inner)
  block = int(np.prod(list(inner.values()))) * plan.tp
  if block > per_host or per_host % block:
    value = '*'.join(f'mesh.{a}={v}' for a, v in inner.items())
    raise ConfigError(
      f'{value} with mesh.tp={plan.tp} would span hosts ({per_host} devices per host): '
      f'{name} and tp stay inside a host; valid: {name}*tp dividing {per_host}'
    )
  devices = sorted(devices, key=lambda d: (d.process_index, d.id))
  return np.array(devices).reshape(plan.dp, plan.pp, *inner.values(), plan.tp)


def describe_placement(mesh: Mesh, hosts: Sequence[str] | None = None) -> list[str]:
  """One line per device: its (dp, pp, tp) coordinate (cp too when the mesh has it), host
  (`hosts[process_index]` when given), process and device id."""
  lines = []
  for idx in np.ndindex(mesh.devices.shape):
    d = mesh.devices[idx]
    host = f'host {hosts[d.process_index]} ' if hosts and d.process_index < len(hosts) else ''
    coord = ', '.join(f'{a}={i}' for a, i in zip(mesh.axis_names, idx, strict=True))
    lines.append(f'  ({coord}) -> {host}process {d.process_index} device {d.id} ({d.device_kind})')
  return lines
