"""KvferryConnector: the class vLLM loads; thin glue onto TransferScheduler / TransferWorker.

Load it with ``kv_connector_module_path: kvferry.connectors.connector`` and
``kv_connector: KvferryConnector`` (or just ``kv_connector: KvferryConnector`` once the
``vllm.general_plugins`` entry point registered it). A request's path: the router sends
P ``do_remote_decode``; P's scheduler keeps the blocks and returns a signed offer
(`scheduler.TransferScheduler.finished`); the router passes it to D; D's scheduler validates
it and allocates blocks (`matched_tokens`, `after_alloc`); D's transfer thread READs
(`worker.TransferWorker`) and notifies P, whose thread reports the blocks freed.
"""

from __future__ import annotations

import logging
from typing import Any

from kvferry.connectors import compat
from kvferry.connectors.compat import KVConnectorBase_V1, KVConnectorMetadata, KVConnectorRole
from kvferry.connectors.config import ConnectorConfig
from kvferry.connectors.memory.registry import backend_class, get_backend
from kvferry.connectors.protocol import timeline
from kvferry.connectors.protocol.params import SECRET_ENV, secret, spend_attempts
from kvferry.connectors.scheduling.scheduler import ReuseSettings, StepMeta, TransferScheduler
from kvferry.connectors.transfer import faults

log = logging.getLogger("vllm." + __name__)  # under vLLM's handlers

OFFER_GUARD_S = 5.0  # a pull offer expires this long before P may free its blocks


def idle_wait_s(idle: bool, prev_idle: bool, delivered: bool, wait_ms: float) -> float:
    """How long get_finished may wait for a transfer result in this step.

    Only a step that computes nothing after another such step waits (the engine would
    otherwise spin while KV is in flight). Not right after a step that delivered results,
    nor right after a forward: with async scheduling that step was planned before vLLM
    saw the previous one's output, and waiting in it would hold back that output (P's
    answer, a loaded request's first token) by up to ``wait_ms``.
    """
    return wait_ms / 1e3 if idle and prev_idle and not delivered else 0.0


def kv_summary(kv: Any) -> str:
    """Shape and dtype of one layer's KV as vLLM passed it: a tensor or a (K, V) pair."""
    if isinstance(kv, tuple | list):
        return "(" + ", ".join(kv_summary(x) for x in kv) + ")"
    return f"{tuple(getattr(kv, 'shape', ()))} {getattr(kv, 'dtype', type(kv).__name__)}"


class KvferryMeta(KVConnectorMetadata):
    """vLLM's per-step connector metadata: the scheduler's `StepMeta` for every worker rank."""

    def __init__(self, step: StepMeta):
        self.step = step


class KvferryConnector(KVConnectorBase_V1):
    """The connector vLLM loads, once per role: on the scheduler side a
    `TransferScheduler`, on each worker rank a `TransferWorker` with its own transfer
    thread. Every hook only hands work over or collects results, so no handshake, NIXL
    call or wait for a peer ever runs on the engine loop."""

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None):
        super().__init__(vllm_config, role, kv_cache_config)
        compat.check_no_sleep_mode(vllm_config)  # before any port or NIXL agent exists
        ktc = vllm_config.kv_transfer_config
        self.cfg = ConnectorConfig.from_extra(ktc.kv_connector_extra_config)
        self.engine_id = str(ktc.engine_id)
        self.block_size = vllm_config.cache_config.block_size
        self._sched: TransferScheduler | None = None
        self._worker = None
        self._bad_blocks: set[int] = set()
        self._delivered = False  # the last get_finished returned something
        self._prev_idle = False  # the last step computed nothing
        self._control = None
        self._backend: Any = None  # worker side, once the KV caches are registered
        self._step = 0  # worker side: engine steps begun (early push waits for the next)
        self._layer_index: dict[str, int] = {}  # layer-wise push on: KV cache name -> layer
        # Boot id: tells a restarted engine (same engine id, different blocks) apart.
        self.instance = str(getattr(vllm_config, "instance_id", "") or id(self))
        self._scheduler: Any = None  # the vLLM Scheduler (D's leases watch its free KV)
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler = compat.constructing_scheduler()
            tp = vllm_config.parallel_config.tensor_parallel_size
            cfg = self.cfg
            if not secret():
                log.warning("kvferry: %s is not set: this engine's offers and leases cannot "
                            "be verified, so every request it decodes recomputes its prompt "
                            "and no lease request is accepted; give every engine and the "
                            "router the same value", SECRET_ENV)
            host_staging = self._host_staging_possible()
            if host_staging:
                log.warning("kvferry: Neuron KV may be staged through host memory "
                            "(neuron_staging is auto or host): this engine keeps no decode "
                            "leases (bidirectional reuse off), because a leased block's host "
                            "mirror would miss every later decode step; set "
                            "neuron_staging: device or mapped to enable reuse")
            self._sched = TransferScheduler(
                self.engine_id, cfg.side_channel_host, cfg.side_channel_port, self.block_size, tp,
                leases=None if host_staging else self._lease_keeper(vllm_config, kv_cache_config, tp),
                reuse=ReuseSettings(cfg.kv_recompute_threshold, cfg.lease_margin_s,
                                    cfg.reuse_read_timeout_s),
                # P frees unread blocks send_timeout_s after the prefill; offers end earlier.
                offer_ttl=max(cfg.send_timeout_s - OFFER_GUARD_S, cfg.send_timeout_s / 2),
                stage_saves=host_staging,
                early_push=cfg.early_push and backend_class(cfg.hardware_backend).supports_fence,
                num_kv_heads=compat.total_kv_heads(vllm_config))

    def _host_staging_possible(self) -> bool:
        """May this engine's workers move KV through host mirrors (neuron/staging.py)?

        Decided from configuration alone, the way NeuronBackend starts (extra config, then
        $KVFERRY_NEURON_STAGING, then auto), because the scheduler process must not touch
        the Neuron runtime. ``auto`` probes the hardware only in the worker, so it counts as
        possible: P then ships `StepMeta.save` lists a device-mode worker ignores, and D
        grants no leases (a stale mirror would be a wrong answer, no lease is a recompute).
        """
        backend = get_backend(self.cfg.hardware_backend)  # constructing, configuring: no hardware
        backend.configure(self._kv_transfer_config.kv_connector_extra_config or {})
        return backend.may_stage  # neuron's device and mapped HBM are registered in place

    def _lease_keeper(self, vllm_config: Any, kv_cache_config: Any, tp: int) -> Any:
        """D's leases (bidirectional reuse) and the router's control channel onto them."""
        from kvferry.connectors.scheduling.lease_keeper import LeaseKeeper
        from kvferry.connectors.transfer.lease_control import ControlServer

        cfg = self.cfg
        try:
            max_blocks = int(compat.num_blocks(vllm_config, kv_cache_config) * cfg.lease_max_fraction)
        except Exception:  # block count unknown yet: bounded by TTL only
            max_blocks = None
        keeper = LeaseKeeper(self.engine_id, self.instance, cfg.side_channel_host,
                             cfg.side_channel_port, self.block_size, tp,
                             ttl=cfg.decoder_kv_blocks_ttl, max_lifetime=cfg.lease_max_lifetime_s,
                             max_blocks=max_blocks or None, free_grace=cfg.lease_free_grace_s,
                             control_port=cfg.control_port(tp))
        try:
            self._control = ControlServer(keeper, cfg.side_channel_host, cfg.control_port(tp))
        except Exception as e:  # leases still end by TTL; the router cannot renew/release
            log.warning("kvferry: lease control channel on port %d unavailable: %s",
                        cfg.control_port(tp), e)
        return keeper

    # -- scheduler side ----------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int):
        if self._sched.early_push:
            self._sched.track_push_prefill(request.request_id, request.prompt_token_ids or [],
                                           request.kv_transfer_params, compat.max_tokens(request))
        return self._sched.matched_tokens(request.request_id, request.prompt_token_ids or [],
                                          request.kv_transfer_params, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int):
        params = request.kv_transfer_params
        self._sched.after_alloc(request.request_id, compat.request_blocks(blocks),
                                num_external_tokens, params if isinstance(params, dict) else None)
        if isinstance(params, dict):
            spend_attempts(params, num_external_tokens > 0)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        sched = self._sched
        staging, pushing = sched.saves is not None, sched.tracks_push()
        if staging or pushing or (timeline.ENABLED and sched.landed):
            progress = compat.step_progress(scheduler_output)
            grown = compat.grown_blocks(scheduler_output) if staging or pushing else {}
            if staging:  # host staging may be active: what P must stage
                sched.plan_saves(progress, grown)
            if pushing:  # early push: prefills completing in this step
                sched.plan_push(progress, grown, compat.preempted(scheduler_output))
            if timeline.ENABLED:
                sched.note_scheduled(progress)
        if sched.leases is not None and sched.leases.num_blocks and self._scheduler is not None:
            self._relieve_pressure(sched.leases)
        meta = self._sched.take_meta()
        meta.idle = compat.scheduled_tokens(scheduler_output) == 0
        return KvferryMeta(meta)

    def _relieve_pressure(self, leases: Any) -> None:
        """Leases yield to live requests before one waits for blocks or is preempted:
        every vLLM version, not only those that ask (`has_pending_block_frees`)."""
        p = compat.kv_pressure(self._scheduler, self.block_size)
        if p is not None:
            leases.relieve(p.free, p.total, p.head_need, self.cfg.lease_free_watermark)

    def update_connector_output(self, connector_output: Any) -> None:
        self._sched.worker_done(set(connector_output.finished_sending or ()),
                                set(connector_output.finished_recving or ()),
                                set(getattr(connector_output, "invalid_block_ids", None) or ()))
        if timeline.ENABLED and self._sched.push.stepping and self._scheduler is not None:
            self._sched.push.note_outputs(self._output_tokens)

    def _output_tokens(self, req_id: str) -> int | None:
        req = self._scheduler.requests.get(req_id)
        return None if req is None else req.num_output_tokens

    def request_finished(self, request: Any, block_ids: Any):
        params = request.kv_transfer_params
        return self._sched.finished(
            request.request_id, request.status in compat.FINISHED_OK,
            compat.first_group(block_ids), params, request.prompt_token_ids or [],
            tokens=compat.all_tokens(request), num_computed=request.num_computed_tokens,
        )

    def has_pending_block_frees(self) -> bool:
        """Asked when allocation fails: P's sends will free blocks, and D's leases yield
        (least recently used first) to live requests rather than forcing preemption."""
        if self._sched is None:
            return False
        if self._sched.waiting_send:
            return True
        leases = self._sched.leases
        return bool(leases is not None and leases.evict_for_pressure())

    # -- worker side -------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, Any], heads_dim: int | None = None) -> None:
        from kvferry.connectors.transfer.worker import TransferWorker

        rank = compat.tp_rank()
        n = compat.num_blocks(self._vllm_config, self._kv_cache_config)
        backend = self._backend = get_backend(self.cfg.hardware_backend)
        backend.configure(self._kv_transfer_config.kv_connector_extra_config or {})
        # Neuron: the framework (libtorch-neuronx) started the runtime before this call;
        # kvferry never initialises it (kvferry/neuron/libnrt.py says why).
        if heads_dim is None and kv_caches:
            heads_dim = backend.kv_heads_dim(kv_caches)
            if heads_dim is None:
                heads_dim = compat.kv_heads_dim(self._vllm_config, kv_caches)
        kv_caches, heads_dim = compat.block_major(kv_caches, heads_dim)  # 0.32+ block-major KV
        layout = backend.describe(kv_caches, n, self.block_size, heads_dim)
        log.info("kvferry: %d KV caches like %s; %d blocks; KV heads at dim %s (%d here)",
                 len(kv_caches), kv_summary(next(iter(kv_caches.values()))), n, heads_dim,
                 layout.num_heads)

        def start(lay: Any) -> TransferWorker:
            # Host staging (neuron): the layout is the DRAM mirror and the worker copies
            # device <-> mirror around transfers; cpu/cuda and the other neuron modes have none.
            staging = backend.staging
            return TransferWorker(self.cfg, self.engine_id, rank, lay,
                                  self.cfg.transport_backends(backend), self.instance,
                                  staging=staging if staging is not None and lay is staging.layout
                                  else None,
                                  tp_size=self._vllm_config.parallel_config.tensor_parallel_size,
                                  num_heads=compat.total_kv_heads(self._vllm_config))

        # Neuron: a registration NIXL refuses moves on to the next mode (device, mapped
        # HBM, host staging); the others register once.
        self._worker = backend.register_with(layout, start)
        if self._worker.layerwise:
            self._layer_index = {name: i for i, name in enumerate(kv_caches)}
        elif self.cfg.layerwise_push:
            log.warning("kvferry: layerwise_push is set but off on this rank: it needs early "
                        "push on a backend with fences, KV planes per layer "
                        "(cross_layer_blocks: false) and NIXL's UCX backend only")

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: Any) -> bool:
        """0.33 asks before accepting --enable-sleep-mode: sleep would free the KV kvferry
        registered with NIXL (`compat.SLEEP_MODE_ERROR`). Older versions never ask; there
        __init__ refuses."""
        return False

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: Any) -> str | None:
        """0.32+: ask for block-major KV (cross-layer blocks, `compat.required_kv_layout`)."""
        ktc = getattr(vllm_config, "kv_transfer_config", None)
        return compat.required_kv_layout(getattr(ktc, "kv_connector_extra_config", None))

    @property
    def prefer_cross_layer_blocks(self) -> bool:
        """0.21-0.26 (V1 model runner): one KV tensor for all layers, block-major."""
        return self.cfg.cross_layer_blocks

    def register_cross_layers_kv_cache(self, kv_cache: Any, attn_backend: Any = None) -> None:
        """vLLM gave one tensor for all layers (it honoured prefer_cross_layer_blocks)."""
        heads_dim = (compat.kv_heads_dim(self._vllm_config, {}, attn_backend, cross_layer=True)
                     if attn_backend is not None else None)
        self.register_kv_caches({"all_layers": kv_cache}, heads_dim)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        """A step begins: its metadata goes to the transfer thread now. Every version
        binds it before the forward, while start_load_kv comes after the forward's launch
        in 0.32+ (`compat`): too late for this step's layer hooks, whose fences the
        transfer thread pairs with the step's prompts."""
        super().bind_connector_metadata(connector_metadata)
        if faults.ACTIVE:
            faults.lost("step")  # a test's slow engine (a `delay` rule): its steps take longer
        if isinstance(connector_metadata, KvferryMeta) and self._worker is not None:
            self._step += 1
            self._worker.submit(connector_metadata.step, self._step)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        """Nothing: the step's READs were handed over with its metadata (bind), and they
        run on the transfer thread, never in the forward's way."""
        return None

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        """Layer-wise push, P: in a step that computes a push prompt's last chunk, each
        layer's KV may be written as soon as this layer's kernels are done (a fence). A
        step replayed as one full CUDA graph calls no hook: its layers go when the whole
        forward's fence passes (wait_for_save), as without layer-wise push."""
        meta = self._connector_metadata
        if (self._layer_index and isinstance(meta, KvferryMeta) and meta.step.push_ready
                and (i := self._layer_index.get(layer_name)) is not None):
            self._worker.layer_done(i, self._backend.fence(), self._step)

    def wait_for_save(self) -> None:
        """After the forward. Host staging, P: copy the blocks it wrote to the host mirror
        now, synchronously, so they are there before request_finished publishes the offer
        D READs one-sidedly. Early push, P: hand the prompts it completed to the transfer
        thread with a fence, so their WRITE starts when the device is done."""
        meta = self._connector_metadata
        if not isinstance(meta, KvferryMeta) or self._worker is None:
            return
        if meta.step.save:
            self._worker.save(meta.step.save)
        if meta.step.push_ready and self._backend.supports_fence:
            # Early push: these prompts' KV is complete once this forward is.
            self._worker.forward_done(meta.step.push_ready, self._backend.fence(), self._step)

    def get_finished(self, finished_req_ids: set[str]):
        if self._worker is None:
            return None, None
        meta = self._connector_metadata
        idle = isinstance(meta, KvferryMeta) and meta.step.idle
        res = self._worker.results(idle_wait_s(idle, self._prev_idle, self._delivered,
                                               self.cfg.idle_step_wait_ms))
        self._prev_idle = idle
        self._bad_blocks |= res.bad_blocks
        self._delivered = bool(res.sent or res.recvd)
        return (res.sent or None), (res.recvd or None)

    def get_block_ids_with_load_errors(self) -> set[int]:
        out, self._bad_blocks = self._bad_blocks, set()
        return out

    def shutdown(self) -> None:
        if self._control is not None:
            self._control.close()
            self._control = None
        if self._worker is not None:
            self._worker.close()
            self._worker = None
