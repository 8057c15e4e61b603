"""One replica group of a fault-tolerant job: attempts, votes, commits, rounds, rejoins.

Each optimizer step is *attempted*: the user's forward and backward, the outer
all-reduce of the grads (issued during backward, engine/outer_sync.py), and one tiny
all-reduce (max) over the outer group that tells every member whether a replica group
waits to join. Nothing in the optimizer's step
crosses replicas (the clip's norm and the update stay inside the replica group). The
replica's ranks then vote (an all-reduce inside the replica group, whose ranks live
and die together). If any of them saw a collective fail, no rank steps, every grad is
dropped and the step is attempted again, so the optimizer state of every survivor is
as before the failed step.

A *round* (:mod:`.protocol`, on the job's etcd) is
formed only when needed: at the start, after a failed attempt, or when a replica waits
to join. It fixes the live replicas, rebuilds the outer groups over them, and copies
a donor's state to replicas that need it (:mod:`.transfer`: point to point, the others
go on to their step). In steady state a step costs two one-element all-reduces (the
joiner flag, the vote) and no store access.

Replicas that disagree (one committed a step whose all-reduce finished for it while
it failed for another) are set right in the next round: every replica arrives with
its step count, and those behind the furthest take the state of a replica there.
"""

from __future__ import annotations

import atexit
import enum
import json
import logging
import os
import socket
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple, NoReturn, cast

import numpy as np
import paddle
import paddle.distributed as dist
from paddle.distributed import fleet

from ..comm import collectives as comm
from ..comm.collectives import CollectiveError
from ..comm.traits import declare
from ..engine import replication
from ..hints import did_you_mean
from . import config, groups, handoff, resume, transfer
from .etcd import (SECURITY_ENV, EtcdReset, EtcdUnavailable, Security, parse_endpoints,
                   security_from_env, wait_until_answers)
from .joint_save import JointSave
from .kv import JobStore, SharedData
from .relay import Relay, RelayedStore
from .pieces import PiecePlan, plan_of
from .protocol import (Arrival, FaultToleranceError, GroupControl, LeaseLost, PhaseMachine,
                       ProtocolError, Round, Rules, WrongBase)
from .trust import SECRET_ENV, Signer, signer_from_env
from .store import (COORDINATOR_ENV, HEARTBEAT_TIMEOUT_ENV, JOIN_WINDOW_ENV, GroupWatch,
                    float_env, heartbeat_timeout_s, join_window_s)

if TYPE_CHECKING:
    from paddle.optimizer import Optimizer
    from paddle.optimizer.lr import LRScheduler

logger = logging.getLogger("paddle_hsdp.ft")

REPLICA_ENV = "PADDLE_HSDP_FT_REPLICA_ID"
START_REPLICAS_ENV = "PADDLE_HSDP_FT_START_REPLICAS"
ROUND_TIMEOUT_ENV = "PADDLE_HSDP_FT_ROUND_TIMEOUT"
REDUNDANCY_ENV = "PADDLE_HSDP_FT_REDUNDANCY"
JOB_ENV = "PADDLE_HSDP_FT_JOB"  # the job's name on a shared etcd (default "default")
# the most ranks a replica group of the job may have: every group lays its buffers out as
# a group of that many would (engine/layout.py, [Note: the layout degree])
MAX_GROUP_SIZE_ENV = "PADDLE_HSDP_FT_MAX_GROUP_SIZE"


KNOWN_ENV = (COORDINATOR_ENV, REPLICA_ENV, START_REPLICAS_ENV, ROUND_TIMEOUT_ENV,
             REDUNDANCY_ENV, HEARTBEAT_TIMEOUT_ENV, JOIN_WINDOW_ENV, JOB_ENV, SECRET_ENV,
             MAX_GROUP_SIZE_ENV, *SECURITY_ENV)


def unknown_env_names(environ: Mapping[str, str] | None = None) -> list[tuple[str, str]]:
    """``PADDLE_HSDP_FT_*`` variables this package does not read (a misspelt
    ``PADDLE_HSDP_FT_START_REPLICA`` would otherwise be ignored in silence, and one
    group would train the job alone), each with the closest known name."""
    environ = os.environ if environ is None else environ
    return [(name, did_you_mean(name, KNOWN_ENV)) for name in sorted(environ)
            if name.startswith("PADDLE_HSDP_FT_") and name not in KNOWN_ENV]


def _int_env(name: str, default: int | None) -> int:
    raw = os.environ.get(name, "")
    if not raw:
        if default is None:
            raise ValueError(f"paddle_hsdp.ft.init needs {name} (or the matching argument)")
        return default
    if not raw.lstrip("-").isdigit() or int(raw) < 0:
        raise ValueError(f"{name} must be an integer >= 0, got {raw!r}")
    return int(raw)


def layout_degree_of(max_group_size: int | None, ranks_per_group: int, inner: int) -> int:
    """The layout degree of a group of ``ranks_per_group`` ranks whose buffers are cut
    among ``inner`` of them, in a job whose groups have at most ``max_group_size`` ranks
    (None: this group's size): the inner degree a group of that size has. Checked on
    every rank alike (its own launch's environment), before any collective."""
    if max_group_size is None:
        return inner
    if isinstance(max_group_size, bool) or not isinstance(max_group_size, int) or \
            max_group_size < ranks_per_group or max_group_size % ranks_per_group:
        raise ValueError(
            f"paddle_hsdp.ft.init(): max_group_size ({MAX_GROUP_SIZE_ENV}) must be a "
            f"multiple of this group's {ranks_per_group} ranks (the same in every group: "
            f"the most ranks any group of the job may have), got {max_group_size!r}")
    return inner * (max_group_size // ranks_per_group)


class _Attached(NamedTuple):
    """What :meth:`Replica.attach` was given that a step needs."""
    model: paddle.nn.Layer
    optimizer: Optimizer


class _Job(NamedTuple):
    """Where the job's shared data lives (``coordinator``, the job's ``name`` on it)
    and how it is reached and trusted: checked on every rank, before any collective."""
    coordinator: str
    name: str
    security: Security
    signer: Signer

    @classmethod
    def from_env(cls, coordinator: str) -> _Job:
        name, security = os.environ.get(JOB_ENV, "") or "default", security_from_env()
        signer = signer_from_env()  # the job's secret: what is read from etcd is checked
        if not name.replace("-", "").replace("_", "").isalnum():
            raise ValueError(f"{JOB_ENV} must be letters, digits, '-' or '_', got {name!r}")
        parse_endpoints(coordinator)  # a bad address is named on every rank, at once
        return cls(coordinator, name, security, signer)


def _checked_hsdp_groups(replica_id: int, start_replicas: int, min_replicas: int) -> Any:
    """fleet's HSDP groups (made by ``fleet.init``, outer degree 1) and ``init``'s
    numbers, checked on every rank alike before any collective."""
    hcg = fleet.get_hybrid_communicate_group()
    hsdp = getattr(hcg, "_hsdp_groups", None)
    if hsdp is None:
        raise RuntimeError("paddle_hsdp.ft.init(): call fleet.init first (after "
                           "`import paddle_hsdp`); the replica group is that job.")
    if hsdp.outer_degree != 1:
        raise ValueError(
            "paddle_hsdp.ft.init(): sharding_configs['fsdp_outer_degree'] must be 1 in "
            f"a fault-tolerant job, got {hsdp.outer_degree}: each replica group is its "
            "own launch job, and the outer groups join the replica groups.")
    if not isinstance(replica_id, int) or replica_id < 0:
        raise ValueError(f"paddle_hsdp.ft.init(): replica_id must be an integer >= 0, "
                         f"got {replica_id!r}")
    if min_replicas < 1 or start_replicas < min_replicas:
        raise ValueError(f"paddle_hsdp.ft.init(): need 1 <= min_replicas <= "
                         f"start_replicas, got min_replicas={min_replicas}, "
                         f"start_replicas={start_replicas}")
    return hsdp


class Replica:
    """This process's view of its replica group (build it with :func:`paddle_hsdp.ft.init`)."""

    _syncs_apart = False  # DiLoCo (set by attach): a step runs and settles owed syncs

    def __init__(self, replica_id: int, coordinator: str, start_replicas: int,
                 min_replicas: int, round_timeout_s: float, max_failed_attempts: int,
                 redundancy: int = 2, max_group_size: int | None = None):
        hsdp = _checked_hsdp_groups(replica_id, start_replicas, min_replicas)
        inner = hsdp.inner(dist.get_rank(), False).nranks
        self.layout_degree = layout_degree_of(max_group_size, dist.get_world_size(), inner)
        pieces = _pieces_of(hsdp.outer_sharding, start_replicas, redundancy)
        self._outer_sharding, self._pieces = hsdp.outer_sharding, pieces
        self._config_hash = ""  # of what every group must share (attach computes it)
        self._logged_replicas: list[int] = []  # the last round's, as the leader logged it
        self._logged_holding: dict[int, list[int]] = {}  # HFSDP: as the leader logged it
        self.replica_id = replica_id
        self.rank, self.ranks_per_replica = dist.get_rank(), dist.get_world_size()
        self.outer = groups.LiveOuterGroup(replica_id, self.rank, self.ranks_per_replica)
        # what the engine and checkpoints read of the live group (comm/traits.py): the
        # joint save and, with HFSDP, the plan the engine cuts the optimizer state by
        declare(self.outer, joint_save=JointSave(self),
                pieces=PiecePlan(pieces, replica_id, self.outer.virtual_rank, redundancy)
                if pieces > 1 else None)
        # HFSDP: the optimizers of the pieces it holds besides its own
        self._piece_optimizers = replication.PieceOptimizers()
        self.round_timeout_s = round_timeout_s
        self.max_failed_attempts = max_failed_attempts
        job = _Job.from_env(coordinator)
        unreachable = self._leader_reaches_etcd(job)
        liveness_s = heartbeat_timeout_s()
        # this replica group's ranks watch each other on the group's own store
        self.control: GroupControl | None = None  # the leader's side of the protocol (below)
        self._watch = GroupWatch(self.rank, self.ranks_per_replica, liveness_s,
                                 self._round_failed, round_timeout_s)
        self._open_job_store(job)
        # this replica group's ranks (a group of one rank has no global group: nothing
        # to vote with)
        self._world = dist.collective._get_global_group() if self.ranks_per_replica > 1 \
            else None
        self._token = self._share_token(unreachable)
        self._take_place(job, Rules(start_replicas, min_replicas, join_window_s(), pieces),
                         liveness_s)
        self._start_progress()
        # last: a failed init leaves fleet's groups as they were
        hsdp.use_live_outer(self.outer)
        hsdp.use_layout_degree(self.layout_degree if self.layout_degree != inner else None)

    def _leader_reaches_etcd(self, job: _Job) -> str | None:
        """The leader, the group's one client of etcd (its mates go through it), waits
        until etcd answers and warns if the job has no secret. Returns why etcd did not
        answer (every rank raises it, after the token's broadcast), else None."""
        if self.rank != 0:
            return None
        unreachable = None
        try:
            wait_until_answers(job.coordinator, self.round_timeout_s, job.security)
        except EtcdUnavailable as e:
            unreachable = str(e)
        if not job.signer.authenticated:
            logger.warning(
                "paddle_hsdp.ft: %s is not set: the rounds' records, group-store addresses "
                "and a rejoin's checksums are not authenticated, so a writer to the job's "
                "etcd could pick the donor or redirect a group. Set it to the same secret "
                "(16+ characters, e.g. `openssl rand -hex 32`) in every replica group, or "
                "keep etcd on a network only the job reaches (docs/fault-tolerance.md, "
                "Trust).", SECRET_ENV)
        return unreachable

    def _open_job_store(self, job: _Job) -> None:
        """The job's shared data: the leader's client of etcd, which serves its mates'
        requests over the group's own store (ft/relay.py); a mate's calls go there."""
        self._relay: Relay | None = None
        self.store: SharedData
        if self.rank == 0:
            self.store = JobStore(job.coordinator, job.name, self.round_timeout_s,
                                  job.security, job.signer)
            if self.ranks_per_replica > 1:
                self._relay = Relay(self.store, self._watch)
                atexit.register(self._relay.stop)
        else:
            self.store = RelayedStore(self._watch, job.name, self.round_timeout_s, job.signer)
        self.store.failed = self._watch.failed

    def _share_token(self, unreachable: str | None) -> str:
        """This process's run of the replica group (keys of a restarted one never meet
        its predecessor's), the leader's on every rank, with whether etcd answered the
        leader: if not, no rank goes on."""
        token = [uuid.uuid4().hex[:12], unreachable]
        if self._world is not None:
            dist.broadcast_object_list(token, src=0)
        if token[1] is not None:
            self._give_up(EtcdUnavailable(token[1]))
        return str(token[0])

    def _take_place(self, job: _Job, rules: Rules, liveness_s: float) -> None:
        """The leader takes the group's place in the job (a lease on its id): a second
        launch of a running id is refused, on every rank of it."""
        refusal: list[str | None] = [None]
        if self.rank == 0:
            control = self.control = GroupControl(
                job.coordinator, job.name, self.replica_id, self._token,
                socket.gethostname(), rules, liveness_s, self.round_timeout_s,
                healthy=self._watch.healthy, on_failure=self._watch.announce,
                on_lost=self._lost, security=job.security, signer=job.signer,
                shared=cast(JobStore, self.store).etcd)  # its 2 connections to etcd
            try:
                control.register()
            except FaultToleranceError as e:
                refusal = [str(e)]
            atexit.register(control.close, revoke=False)
        if self._world is not None:
            dist.broadcast_object_list(refusal, src=0)
        if refusal[0] is not None:
            self._give_up(FaultToleranceError(refusal[0]))

    def _give_up(self, error: Exception) -> NoReturn:
        """Init failed on every rank alike: this rank's watch and relay stop first."""
        self._watch.stop()
        if self._relay is not None:
            self._relay.stop()
        raise error

    def _start_progress(self) -> None:
        """No step taken, no round yet: the counters and records of the steps."""
        self._arrivals = 0
        self._loads = 0  # plain states received from a donor
        self.step = 0  # optimizer steps taken
        self.fresh = True  # state not (yet) known to match a replica's
        self._failed = False  # the last attempt failed
        self._need_round = True  # the next attempt starts with a round
        self._members: list[int] | None = None  # the last round's replicas (leader)
        self._next_round: int | None = None
        self.round: Round | None = None
        self.history: list[dict] = []  # one entry per committed step and per failure
        self._timing: dict[str, float] = {}  # this attempt's (for the log)
        self.model: paddle.nn.Layer | None = None
        self.optimizer: Optimizer | None = None
        self.lr_scheduler: LRScheduler | None = None
        self._state_fn: Callable[[], object] | None = None
        self._load_state_fn: Callable[[Any], object] | None = None
        self._user_state: str | None = None  # the user's (JSON), as of this step's start
        self._resume_path: str | None = None  # a checkpoint resumed from, until a commit
        # a rejoin's state handed over beside the step (this rank's side), until used
        self._handoff: handoff.Donation | handoff.Receipt | None = None

    # ------------------------------------------------------------ set-up
    def attach(self, model: paddle.nn.Layer, optimizer: Optimizer,
               lr_scheduler: LRScheduler | None = None,
               state_dict: Callable[[], object] | None = None,
               load_state_dict: Callable[[Any], object] | None = None) -> None:
        """What a step trains and what a rejoining replica receives: the sharded
        ``model``, its ``optimizer`` (and ``lr_scheduler``, stepped after each committed
        step), and optionally the user's own plain state (``state_dict()`` returns a
        JSON-serialisable object, ``load_state_dict(obj)`` takes it; then ``train_step`` fetches
        each batch through ``next_batch``, after any state is loaded)."""
        if (state_dict is None) != (load_state_dict is None):
            raise ValueError("Replica.attach: give state_dict and load_state_dict together "
                             f"(got state_dict={state_dict!r}, load_state_dict="
                             f"{load_state_dict!r}): a donor sends what one returns and a "
                             "rejoining group loads it with the other.")
        why = replication.refusal_to_replicate(model, self.outer)
        if why is not None:
            raise NotImplementedError(f"paddle_hsdp.ft: {why}")
        # DiLoCo: its outer state whole on every group, its syncs run by the next attempt
        self._syncs_apart = replication.keep_outer_state_on_every_replica(model)
        self.model, self.optimizer, self.lr_scheduler = model, optimizer, lr_scheduler
        self._state_fn, self._load_state_fn = state_dict, load_state_dict
        plan = self.piece_plan
        why_not = replication.why_no_second_piece(optimizer) if plan is not None else None
        if plan is not None and why_not is not None:  # (alike on every group: one program)
            plan.redundancy = 1  # a piece is never short of one holder: no re-cut
            logger.warning("paddle_hsdp.ft: HFSDP's pieces are not re-cut among the "
                           "survivors: %s; a piece's redundancy comes back when a holder "
                           "rejoins", why_not)
        if self.rank == 0:  # the leader arrives with it: a misconfigured group is refused
            tensors = replication.parameter_table(model)
            self._config_hash, text = config.digest(config.describe(
                self.ranks_per_replica, self._outer_sharding, self._pieces, tensors,
                replication.outer_sync_table(model), self.layout_degree))
            self._leader().publish_config(self._config_hash, text)

    def load_checkpoint(self, path: str | os.PathLike) -> None:
        """Resume the job from its joint checkpoint at ``path`` (``save_checkpoint`` on
        every live group): on every rank of every group, after :meth:`attach`, before
        the first :meth:`train_step`. The step, RNG, scheduler and ``attach``'s user
        state load now; the model and optimizer in the first round, once the outer
        groups over the live groups exist, which then read the checkpoint about once
        between them (:mod:`.resume`). Bad input raises here, on every rank alike."""
        self._resume_path = resume.start(self, path)

    def resume_state(self) -> dict:
        """What a resume from a checkpoint saved now needs beyond tensors: this rank's
        step, RNG, scheduler and user state (``attach``'s ``state_dict()`` now, after
        the last committed step's batch). The joint save stores it."""
        state = self._plain_state()
        state["user"] = json.loads(_user_json(self._state_fn())) if self._state_fn else None
        state["rank"] = self.rank
        return state

    @property
    def piece_plan(self) -> PiecePlan | None:
        """HFSDP with redundancy: who holds which piece of the optimizer state (declared
        on the live outer group at init, ``ft.pieces.PiecePlan``); None otherwise."""
        return plan_of(self.outer)

    def _leader(self) -> GroupControl:
        """The group's side of the protocol, which its leader (rank 0) runs."""
        control = self.control
        if control is None:
            raise ProtocolError(f"paddle_hsdp.ft: rank {self.rank} of replica "
                                f"{self.replica_id} has no GroupControl: only the group's "
                                "leader (rank 0) takes part in rounds")
        return control

    def _attached(self) -> _Attached:
        """The model and optimizer :meth:`attach` was given."""
        model, optimizer = self.model, self.optimizer
        if model is None or optimizer is None:
            raise RuntimeError("Replica.train_step: call attach(model, optimizer) first")
        return _Attached(model, optimizer)

    @property
    def live_replicas(self) -> list[int]:
        """The replicas of the current round (sorted ids)."""
        return list(self.round.replicas) if self.round is not None else [self.replica_id]

    # ------------------------------------------------------------ the step
    def train_step(self, forward_backward: Callable[..., Any],
                   next_batch: Callable[[], Any] | None = None) -> Any:
        """Take one optimizer step and return the loss of its committed attempt.

        ``forward_backward()`` runs forward and backward on this step's batch (chosen
        from ``self.step``) and returns the loss; with ``next_batch``, the batch is
        fetched here by ``next_batch()`` and handed over, ``forward_backward(batch)``.
        A failed attempt is run again, on the same batch. The batch is fetched only
        once this step's round has loaded any state this group receives (its step,
        RNG, scheduler and the ``state_dict`` given to :meth:`attach`, e.g. a loader's
        position), and fetched again if a later attempt's round loads state anew: a
        batch fetched before ``train_step`` would be the stale one of the group's old
        position. So a job that attaches its own ``load_state_dict`` must pass
        ``next_batch``."""
        if self.model is None:
            raise RuntimeError("Replica.train_step: call attach(model, optimizer) first")
        if next_batch is None and self._load_state_fn is not None:
            raise ValueError(
                "Replica.train_step: attach() was given load_state_dict (your state, such "
                "as a loader's position, comes from the donor when this group rejoins), so "
                "pass next_batch=: train_step fetches the batch after loading it, "
                "train_step(forward_backward, next_batch=lambda: next(loader)), and calls "
                "forward_backward(batch). A batch fetched before train_step would be the "
                "stale one of the group's old position.")
        return _Step(self, forward_backward, next_batch).run()

    def finish(self) -> None:
        """The training loop is over: a replica group still waiting to join stops with
        a message instead of waiting out the round timeout (call it on every rank)."""
        if isinstance(self._handoff, handoff.Donation):  # a receiver may still be taking it
            self._handoff.join(self.round_timeout_s)
        if self.rank == 0:
            self._leader().finish()

    def _joiners_waiting(self) -> paddle.Tensor:
        """Whether any replica group waits to join, as every member learns it: this
        rank's view (the leader hears joiners from etcd) all-reduced (max) over the
        outer group; the replica's vote then spreads the leader's column's answer to
        its mates. One tiny all-reduce per step, no store access; the flag stays a
        tensor, read with the vote (one host sync a step, not two)."""
        waiting = self.control is not None and self.control.join_waiting()
        flag = paddle.to_tensor(np.array([1.0 if waiting else 0.0], dtype="float32"))
        comm.all_reduce(flag, self.outer, op="max", tag="ft control")
        return flag

    def _replica_votes(self, failed: bool,
                       join_wanted: bool | paddle.Tensor) -> tuple[bool, bool]:
        """Every rank of this replica group learns whether any of them failed the attempt
        and whether a replica waits to join (an all-reduce inside the replica group,
        whose ranks live and die together). ``join_wanted``: a bool, or the outer
        all-reduce's flag tensor (read here, with the vote)."""
        if isinstance(join_wanted, bool):
            join_wanted = paddle.to_tensor(np.array([float(join_wanted)], "float32"))
        flags = paddle.concat([paddle.to_tensor(np.array([float(failed)], "float32")),
                               join_wanted.reshape([1]).astype("float32")])
        if self._world is not None:
            comm.all_reduce(flags, self._world, op="max", tag="ft vote")
        failed_any, join_any = flags.numpy().tolist()  # the step's one host sync
        return bool(failed_any), bool(join_any)

    def _arrive(self) -> Round:
        """The round of this attempt: the leader forms it on the job's etcd, its
        replica-mates read it from the group's own store (a gloo collective here could
        time out while the leader waits for other replicas): the changes since the
        group's last round, which every rank of it holds (``Round.to_delta``)."""
        self._arrivals += 1
        name = f"round/{self._token}/{self._arrivals}"
        self._watch.armed = None  # nothing is watched while a round forms
        if self.rank == 0:
            try:
                record = self._form_round()
            except FaultToleranceError as e:  # refused, or no round: mates hear it too
                self._watch.publish(name, "refused:" + str(e))
                raise
            except EtcdUnavailable as e:  # etcd away past the round timeout: the same
                self._watch.publish(name, "unavailable:" + str(e))
                raise
            self._watch.publish(name, record.to_delta(self.round))
        else:
            # the leader's waits for etcd end within the round timeout (twice: a
            # restarted etcd, then the round's own wait)
            text = self._watch.read(name, 2 * self.round_timeout_s,
                                    f"replica {self.replica_id}'s leader to join a round")
            for prefix, error in (("refused:", FaultToleranceError),
                                  ("unavailable:", EtcdUnavailable)):
                if text.startswith(prefix):
                    raise error(text[len(prefix):])
            try:
                record = Round.from_delta(text, self.round)
            except WrongBase as e:  # every rank of a group ends each _arrive alike
                raise ProtocolError(f"paddle_hsdp.ft: rank {self.rank} of replica "
                                    f"{self.replica_id} holds another round than its "
                                    f"leader: {e}") from None
        self._next_round, self.round = record.number + 1, record
        self._watch.armed = record.number
        return record

    def _form_round(self) -> Round:
        """The leader: arrive at the next round (as a joiner at the next open one if
        this group is new, was left out, or lost its place) until one takes it in."""
        control, number = self._leader(), None
        # once the job has trained, fresh groups alone must not form a round
        needs_state = self.round is not None and any(
            not a.fresh for a in self.round.members.values())
        while True:
            if control.unavailable is not None:  # etcd away past the round timeout
                raise EtcdUnavailable(control.unavailable)
            if control.lost is not None:  # its lease ended: the job went on without it
                why = control.lost
                control.register()
                if control.take_reset():
                    # etcd lost its data, not the job this group: every group meets at
                    # one round with the step it holds (its state is as good as before)
                    number = control.restart_round(
                        self._next_round if self._next_round is not None else 0)
                    logger.warning("paddle_hsdp.ft: replica %d meets the other groups at "
                                   "round %d, at its step %d (%s)", self.replica_id,
                                   number, self.step, why)
                else:
                    logger.warning("paddle_hsdp.ft: replica %d rejoins the job as a new "
                                   "group (%s)", self.replica_id, why)
                    self._next_round, self._members, self.fresh = None, None, True
                    number = None
            try:
                if number is None:
                    number = self._next_round if self._next_round is not None \
                        else control.next_open()
                plan = self.piece_plan
                arrival = Arrival(self.step, self.fresh, self._failed, self._config_hash,
                                  plan.valid_extra() if plan is not None else ())
                record = control.arrive(number, self._members, arrival, needs_state)
                if record is None:
                    # left out (or the members went past): a joiner at the next open round
                    number = max(number + 1, control.next_open())
                    self._members, self.fresh = None, True
                    continue
            except (LeaseLost, EtcdReset):  # (a lost etcd: _on_reset marked it lost)
                continue  # registered again above
            self._members = record.replicas
            return record

    def _round_failed(self, round_number: int) -> None:
        """A failure of round ``round_number`` was announced in this group (by a rank
        whose collective failed, or by the leader when etcd told it): this rank's outer
        group is shut down now, and the leader tells the other groups (once a round)."""
        self.outer.shut_down(round_number)
        if self.control is not None:
            self.control.announce_failure(round_number)

    def _lost(self, why: str) -> None:
        """The leader's lease ended (its group stopped answering, or was cut off): the
        others go on without it, so this group's attempt fails now."""
        armed = self._watch.armed
        if armed is not None:
            self._watch.announce(armed)

    def _set_up_round(self, record: Round, receiving: bool,
                      sitting_out: Sequence[int] = ()) -> Exception | None:
        """New outer groups and the donor's state where the round needs them (or, for
        receivers ``sitting_out`` its step, the handoff's start); the error if that
        failed (a peer died or never came), None if it worked."""
        try:
            self._close_handoff()
            if record.rebuild:
                began = time.perf_counter()
                self.outer.adopt(record.replicas, groups.connect(
                    self.store, record.number, record.replicas, self.outer,
                    self.round_timeout_s), record.number)
                self._timing["creation_s"] = time.perf_counter() - began
                # the outer syncs' order is agreed anew over the new members at the
                # next backward (which syncs at the step), whatever each went through
                replication.order_outer_syncs_again(self._attached().model)
            else:
                self.outer.carry_into(record.number)
            if self._resume_path is not None:  # the tensors resumed from, before a transfer
                self._timing["resume_bytes"] = resume.load_in_round(
                    self, self._resume_path, record, receiving)
            plan = self.piece_plan
            if plan is not None:  # (new pieces' optimizers take their state below)
                self._piece_optimizers.take(self._attached().optimizer, plan.extra)
            if sitting_out:
                self._hand_over(record, receiving)
            elif record.receivers or (plan is not None and plan.copies):
                self._stream_state(record, receiving)
            if plan is not None:
                self._piece_optimizers.keep_only(plan.extra)
                # every member rebuilds every piece from its round's holders before the
                # next forward, whatever its last rebuild did (it may have failed half-way
                # on one rank and not another; a receiver holds the donor's pieces)
                replication.owe_rebuild(self._attached().model)
        except (CollectiveError, FaultToleranceError) as e:
            return e
        except Exception as e:  # noqa: BLE001 - see below
            # A peer that dies during the set-up surfaces as whatever Paddle's store and
            # process-group creation raise (RuntimeError, TimeoutError, and a ValueError
            # "TCP receive error ... Connection reset by peer" from ProcessGroupGloo.create):
            # every one is a failed round, and the next round goes on without the dead.
            logger.warning("rank %d: round %d set-up failed (%s: %s); the next round goes "
                           "on without whoever failed", self.rank, record.number,
                           type(e).__name__, e)
            return FaultToleranceError(f"paddle_hsdp.ft: round {record.number} set-up "
                                       f"failed: {type(e).__name__}: {e}")
        return None

    def _stream_state(self, record: Round, receiving: bool) -> None:
        """Round ``record``'s state to its receivers in its set-up
        (:func:`.transfer.stream_state`): a receiver loads its donor's step, RNG,
        scheduler and user state."""
        model, optimizer = self._attached()
        extra, self._timing["state_bytes"] = transfer.stream_state(
            self.store, record, self.outer, model, optimizer, self._plain_state(),
            self._piece_optimizers.by_piece)
        if receiving:
            if extra is None:  # a receiver takes the model, and the state with it
                raise FaultToleranceError(
                    f"paddle_hsdp.ft: replica {self.replica_id} received no state from its "
                    f"donor in round {record.number}")
            self._load_plain_state(extra)

    def _hand_over(self, record: Round, receiving: bool) -> None:
        """The receivers sit the step out (:mod:`.handoff`): a donor serves the state
        its step starts from beside the step; a receiver starts taking it. Neither
        waits for the other here: the receiver runs the step on its own stale state
        and loads the donor's plain state with the tensors, after the step's
        all-reduce (:meth:`_take_handoff`)."""
        model, optimizer = self._attached()
        fed = [r for r in record.receivers if record.donor_of(r) == self.replica_id]
        if fed:
            self._handoff = handoff.Donation(self.store, record, self.outer, model,
                                             optimizer, fed,
                                             lambda: self._watch.announce(record.number))
            self._timing["snapshot_bytes"] = self._handoff.bytes
        elif receiving:
            self._handoff = handoff.Receipt(self.store, record, self.outer, model,
                                            record.donor_of(self.replica_id))

    def _donor_stepped(self) -> None:
        """A donor's forward and backward are done: its plain state as of now (its
        RNG past the forward, its loader past the step's batch) goes to its receivers
        after the bytes, so theirs match its own from the next step on."""
        if isinstance(self._handoff, handoff.Donation) and self._handoff.awaits_plain_state:
            try:  # (mid-step: an error here would leave this group out of the all-reduce)
                user = _user_json(self._state_fn()) if self._state_fn else None
                plain = self._plain_state(user)
            except (TypeError, ValueError) as e:  # its receivers' attempts fail, named
                self._handoff.refuse(f"{type(e).__name__}: {e}")
                return
            self._handoff.stepped(plain)

    def _take_handoff(self, record: Round) -> None:
        """A receiver that sat the step out, once its all-reduce is through: the
        donor's state of the step's start installed (the optimizer then applies the
        step's grads to it); raises if it did not arrive whole."""
        receipt = self._handoff
        if not isinstance(receipt, handoff.Receipt):
            raise ProtocolError("paddle_hsdp.ft: a receiver sat a step out with no handoff")
        self._handoff = None
        began = time.perf_counter()
        model, optimizer = self._attached()
        try:
            self._timing["state_bytes"] = receipt.install(
                model, optimizer, groups._abort_on_failure(self.store, record.number))
        finally:
            receipt.close()
        if receipt.extra is None:
            raise ProtocolError("paddle_hsdp.ft: a handoff installed without its plain state")
        self._load_plain_state(receipt.extra)  # the donor's, as its backward left it
        self._timing["handoff_wait_s"] = time.perf_counter() - began

    def _close_handoff(self) -> None:
        """A handoff of an earlier round is over: its socket and copy go."""
        if self._handoff is not None:
            self._handoff.close()
            self._handoff = None

    def _plain_state(self, user_state: str | None = None) -> dict:
        """Step, RNG, scheduler and the user's state (``user_state``, JSON; default:
        as of this step's start, before its batch was fetched)."""
        user_state = user_state if user_state is not None else self._user_state
        return {"step": self.step, "rng": [s.__getstate__() for s in paddle.get_rng_state()],
                "lr_scheduler": (self.lr_scheduler.state_dict()
                                 if self.lr_scheduler is not None else None),
                "user": json.loads(user_state) if user_state else None}

    def _load_plain_state(self, extra: dict) -> None:
        self._loads += 1
        self.step = extra["step"]
        paddle.set_rng_state([_generator_state(s) for s in extra["rng"]])
        if self.lr_scheduler is not None and extra["lr_scheduler"] is not None:
            self.lr_scheduler.set_state_dict(extra["lr_scheduler"])
        if self._load_state_fn is not None:
            self._load_state_fn(extra["user"])
            # what this group sends if it donates later in this step: what it holds now
            self._user_state = json.dumps(extra["user"])
        self.fresh = False

    def _log(self, record: Round, started: float, kind: str,
             error: Exception | None = None, sitting_out: Sequence[int] = ()) -> None:
        """One history entry per attempt: ``replicas``, the groups whose grads it
        averaged (not those ``sitting_out``, which ``sat_out`` names)."""
        trained = [r for r in record.replicas if r not in sitting_out]
        entry = {"kind": kind, "step": self.step, "round": record.number,
                 "replicas": trained, "seconds": time.perf_counter() - started,
                 "time": time.time(), **self._timing}
        if sitting_out:
            entry["sat_out"] = list(sitting_out)
        if "round_s" in self._timing:
            entry.update(rebuild=record.rebuild, receivers=record.receivers,
                         donor=record.donor,
                         donors={r: record.donor_of(r) for r in record.receivers},
                         point_to_point=transfer.plan_transfer(record, self.piece_plan)[1])
            pieces = self.piece_plan
            if pieces is not None:
                entry["piece_donors"] = {q: pieces.donor(q) for q in range(pieces.parts)}
                entry.update(piece_holders=pieces.holding, piece_copies=pieces.copies)
        if error is not None:
            entry["error"] = str(error)[:300]
        self.history.append(entry)
        if self.rank == 0 and "round_s" in self._timing:
            self._log_membership(record, sitting_out)
            self._log_holders(record)
        if self.rank == 0:
            if kind == "step":
                logger.info("step %d: %d replicas %s", self.step, len(trained), trained)
            elif kind == "sat out":
                logger.info("replica %d sat step %d out and took its donor's state of it "
                            "(round %d)", self.replica_id, self.step, record.number)
            else:
                logger.warning("step %d failed (replicas %s): %s", self.step + 1,
                               record.replicas, str(error)[:200])


    def _log_holders(self, record: Round) -> None:
        """HFSDP: one line when a round changes who holds which piece (the re-cut)."""
        plan = self.piece_plan
        if plan is None or plan.holding == self._logged_holding:
            return
        self._logged_holding = plan.holding
        copies = ", ".join(f"piece {q} {d} -> {t}" for q, d, t in plan.copies) or "none"
        logger.warning("paddle_hsdp.ft: round %d: piece holders %s (copies: %s)",
                       record.number, plan.holding, copies)

    def _log_membership(self, record: Round, sitting_out: Sequence[int] = ()) -> None:
        """One line when a round changes who trains: the groups that left and joined
        since the last round this leader logged, and where a receiver's state came from
        and how long the round's set-up took."""
        before, now = self._logged_replicas, record.replicas
        left, joined = [r for r in before if r not in now], [r for r in now if r not in before]
        self._logged_replicas = now
        if not (left or joined or record.receivers):
            return
        parts = [f"left {left} (" + "; ".join(
            f"{r}: {record.left.get(r, 'not in this round')}" for r in left) + ")"] \
            if left else []
        parts += [f"joined {joined}"] if joined else []
        donors = ", ".join(f"{r} from {record.donor_of(r)}" for r in record.receivers)
        if sitting_out:
            parts.append(f"replica(s) sit step {record.step + 1} out, their state of its "
                         f"start handed over beside it ({donors})")
        elif record.receivers:
            parts.append(f"replica(s) took the state of step {record.step} ({donors}; "
                         f"{self._timing.get('state_bytes', 0) / 2 ** 20:.1f} MiB through "
                         "this rank)")
        logger.warning("paddle_hsdp.ft: round %d: %s; %d replicas %s (round %.2f s, "
                       "set-up %.2f s)", record.number, ", ".join(parts), len(now), now,
                       self._timing.get("round_s", 0.0), self._timing.get("set_up_s", 0.0))


class StepPhase(enum.Enum):
    """Where an attempt of one optimizer step is (:class:`_Step`)."""

    #: an attempt begins: a round first (on etcd), if one is needed
    ARRIVING = "arriving"
    #: the round's outer groups and any donor's state, and the group's vote on them
    SETTING_UP = "setting up"
    #: the batch, forward and backward, the grads' outer sync, the joiner flag
    RUNNING = "running"
    #: this rank's attempt failed: its group and the others are told before the vote
    ANNOUNCING = "announcing a failure"
    #: the replica group's ranks agree whether the attempt failed, a joiner waits
    VOTING = "voting"
    #: nobody failed: the optimizer (and scheduler) steps
    COMMITTING = "committing"
    #: someone failed: every grad is dropped, the next attempt starts with a round
    RETRYING = "retrying"
    #: the step is committed
    DONE = "done"


_P = StepPhase
#: Every move between an attempt's phases :class:`_Step` may make.
STEP_TRANSITIONS: dict[StepPhase, frozenset[StepPhase]] = {
    _P.ARRIVING: frozenset({_P.SETTING_UP, _P.RUNNING}),  # a round, or the last one's
    _P.SETTING_UP: frozenset({_P.RUNNING, _P.ANNOUNCING}),  # ... set up, or failed
    _P.RUNNING: frozenset({_P.VOTING, _P.ANNOUNCING}),
    _P.ANNOUNCING: frozenset({_P.VOTING}),  # (peers may be blocked on this rank)
    _P.VOTING: frozenset({_P.COMMITTING, _P.RETRYING}),
    # ... or, a receiver that sat the step out, the next step in the same call
    _P.COMMITTING: frozenset({_P.DONE, _P.ARRIVING}),
    _P.RETRYING: frozenset({_P.ARRIVING}),
    _P.DONE: frozenset(),
}


class _Step(PhaseMachine[StepPhase]):
    """One optimizer step of a replica group (:meth:`Replica.train_step`), attempted
    until an attempt commits: one method per :class:`StepPhase`, each returning the
    next, every move checked against :data:`STEP_TRANSITIONS`. What outlasts an
    attempt: the batch (fetched again only once a round loaded the user's state anew)
    and the count of failed attempts."""

    transitions = STEP_TRANSITIONS
    what, table = "a step's attempt", "ft/replica.py STEP_TRANSITIONS"

    def __init__(self, replica: Replica, forward_backward: Callable[..., Any],
                 next_batch: Callable[[], Any] | None):
        self.replica, self.optimizer = replica, replica._attached().optimizer
        self.forward_backward, self.next_batch = forward_backward, next_batch
        self.phase = StepPhase.ARRIVING
        self.batch, self.batch_loads = None, -1  # the fetched batch, and _loads then
        self.failures = 0
        # what a donor sends is the user's state before this step's batch was fetched
        # (a retried attempt has fetched it already): the receiver fetches the same one
        replica._user_state = _user_json(replica._state_fn()) if replica._state_fn else None
        # this attempt's (set anew as each begins): the members sitting it out
        self.started, self.receiving = 0.0, False
        self.sitting_out: list[int] = []
        self.record: Round | None = None
        self.loss: Any = None
        self.error: Exception | None = None
        # whether a group waits to join: the outer all-reduce's flag, then the vote's
        self.join_wanted: bool | paddle.Tensor = False

    def run(self) -> Any:
        """Attempt the step until an attempt commits; the loss of that attempt."""
        phases = {_P.ARRIVING: self._arrive, _P.SETTING_UP: self._set_up,
                  _P.RUNNING: self._train, _P.ANNOUNCING: self._announce_failure,
                  _P.VOTING: self._vote, _P.COMMITTING: self._commit,
                  _P.RETRYING: self._retry}
        self._run_phases({phase: self._timed(phase, run) for phase, run in phases.items()},
                         _P.DONE)
        return self.loss

    def _timed(self, phase: StepPhase, run: Callable[[], StepPhase]
               ) -> Callable[[], StepPhase]:
        """``run``, its seconds added to the attempt's log as ``<phase>_s`` (the round
        and the set-up have their own: ``round_s``, ``set_up_s``)."""
        if phase in (_P.ARRIVING, _P.SETTING_UP):
            return run

        def timed() -> StepPhase:
            began = time.perf_counter()
            try:
                return run()
            finally:
                key = f"{phase.name.lower()}_s"
                timing = self.replica._timing
                timing[key] = timing.get(key, 0.0) + time.perf_counter() - began
        return timed

    def _arrive(self) -> StepPhase:
        replica = self.replica
        self.started, replica._timing = time.perf_counter(), {}
        self.loss, self.error, self.receiving, self.join_wanted = None, None, False, False
        self.sitting_out = []
        declare(replica.outer, contributing=None)  # every member's grads count
        if not replica._need_round:
            if replica.round is None:  # a replica group's first attempt starts with a round
                raise ProtocolError("paddle_hsdp.ft: an attempt outside any round")
            self.record = replica.round
            return _P.RUNNING
        self.record = replica.round = replica._arrive()
        self.receiving = replica.replica_id in self.record.receivers
        plan = replica.piece_plan
        if plan is not None:  # a lost piece ends the job on every rank alike
            plan.arrange(self.record)
        replica._timing["round_s"] = time.perf_counter() - self.started
        return _P.SETTING_UP

    def _set_up(self) -> StepPhase:
        replica, record = self.replica, self._record()
        sitting_out = handoff.sits_out(record, replica.piece_plan, replica._syncs_apart)
        error = replica._set_up_round(record, self.receiving, sitting_out)
        logger.debug("rank %d: round %d set up (%s)", replica.rank, record.number,
                     error or "ok")
        replica._timing["set_up_s"] = time.perf_counter() - self.started - \
            replica._timing["round_s"]
        if error is None and sitting_out:  # (alike on every member: the round's record)
            self.sitting_out = sitting_out
            # the grads' mean is over the others; withheld grads must not be synced
            # during backward, so this step syncs at its end (a rebuild does it already)
            declare(replica.outer, contributing=len(record.replicas) - len(sitting_out))
            if not record.rebuild:
                replication.order_outer_syncs_again(replica._attached().model)
        # a set-up that failed on one rank fails the attempt on all of them before any
        # inner collective of the step (which the failed rank skips)
        began = time.perf_counter()
        failed = replica._replica_votes(error is not None, False)[0]
        replica._timing["set_up_vote_s"] = time.perf_counter() - began
        if failed:
            self.error = error or FaultToleranceError(
                "paddle_hsdp.ft: a replica-mate's round set-up failed")
            return _P.ANNOUNCING
        return _P.RUNNING

    def _train(self) -> StepPhase:
        replica = self.replica
        replica._need_round = False
        sitting = replica.replica_id in self.sitting_out
        try:
            if replica._syncs_apart:  # DiLoCo: the sync the last step owes, over the round
                replication.run_owed_outer_syncs(replica._attached().model)
            began = time.perf_counter()
            self.loss = self._forward_backward()
            replica._timing["forward_backward_s"] = time.perf_counter() - began
            replica._donor_stepped()
            if sitting:  # its state is not the round's yet: it adds zeros
                replication.withhold_grads(replica._attached().model)
            # after the grads' all-reduces: a group whose backward issued them early
            # and one that issues them here send them in one order
            replication.finish_grad_sync(self.optimizer)
            replica._timing["grad_sync_s"] = time.perf_counter() - began - \
                replica._timing["forward_backward_s"]
            self.join_wanted = replica._joiners_waiting()
            if sitting:  # the others are past this group now; only it waits
                replica._take_handoff(self._record())
        except (CollectiveError, FaultToleranceError) as e:
            self.error = e
            return _P.ANNOUNCING
        return _P.VOTING

    def _forward_backward(self) -> Any:
        if self.next_batch is None:
            return self.forward_backward()
        # the first attempt's batch; fetched again only once the user's state (the
        # loader's position) was loaded since
        loads = self.replica._loads
        if self.batch_loads < 0 or (self.batch_loads != loads
                                    and self.replica._load_state_fn is not None):
            self.batch, self.batch_loads = self.next_batch(), loads
        return self.forward_backward(self.batch)

    def _announce_failure(self) -> StepPhase:
        """Before the vote (peers may be blocked on this rank): this group's ranks at
        once; the other groups through the leader (its watch relays a mate's
        announcement): one request per group, not per rank."""
        replica, number = self.replica, self._record().number
        replica._watch.announce(number)
        if replica.control is not None:
            replica.control.announce_failure(number)
        replica.outer.abandon()
        return _P.VOTING

    def _vote(self) -> StepPhase:
        replica = self.replica
        failed, join_wanted = replica._replica_votes(self.error is not None, self.join_wanted)
        logger.debug("rank %d: step %d attempt: failed %s (%s), join wanted %s", replica.rank,
                     replica.step + 1, failed, self.error, join_wanted)
        replica._need_round = failed or join_wanted
        if replica.control is not None:
            replica.control.failed() if failed else replica.control.committed()
        return _P.RETRYING if failed else _P.COMMITTING

    def _commit(self) -> StepPhase:
        replica = self.replica
        if replica._syncs_apart:
            replication.settle_outer_syncs(replica._attached().model, committed=True)
        self.optimizer.step()
        replica._piece_optimizers.step()  # HFSDP: the pieces held besides its own
        if replica.piece_plan is not None:
            replica.piece_plan.committed()
        if replica.lr_scheduler is not None:
            replica.lr_scheduler.step()
        self.optimizer.clear_grad()
        replica.step += 1
        replica._failed = replica.fresh = False
        replica._resume_path = None  # resumed: a later round loads nothing
        if replica.replica_id in self.sitting_out:
            return self._sat_out()
        replica._log(self._record(), self.started, "step", sitting_out=self.sitting_out)
        return _P.DONE

    def _sat_out(self) -> StepPhase:
        """This group sat the step out and now holds the state it left (the donor's,
        updated with the step's grads): the next step within this ``train_step``, so
        its caller sees the steps it trained. Its batch is fetched anew (the step it sat
        out took one), and what it sends if it donates is its state as of now."""
        replica = self.replica
        replica._log(self._record(), self.started, "sat out", sitting_out=self.sitting_out)
        self.batch_loads = -1
        replica._user_state = _user_json(replica._state_fn()) if replica._state_fn else None
        return _P.ARRIVING

    def _retry(self) -> StepPhase:
        replica = self.replica
        self.optimizer.clear_grad()  # every grad of the attempt, synced or not
        if replica._syncs_apart:
            replication.settle_outer_syncs(replica._attached().model, committed=False)
        declare(replica.outer, contributing=None)
        replica._failed = True
        replica.fresh = replica.fresh or self.receiving
        self.failures += 1
        replica._log(self._record(), self.started, "failed", self.error)
        if self.failures > replica.max_failed_attempts:
            raise FaultToleranceError(
                f"paddle_hsdp.ft: step {replica.step} failed {self.failures} times in a "
                f"row; the last error: {self.error}")
        return _P.ARRIVING

    def _record(self) -> Round:
        """This attempt's round (set as it arrives)."""
        if self.record is None:
            raise ProtocolError("paddle_hsdp.ft: an attempt outside any round")
        return self.record


def _user_json(state: object) -> str:
    """The user's state (``attach``'s ``state_dict()``) as the JSON a donor sends."""
    try:
        return json.dumps(state)
    except (TypeError, ValueError) as e:
        raise ValueError(f"Replica.attach: state_dict() must return JSON-serialisable "
                         f"values (numbers, strings, lists, dicts), got {e}: a rejoining "
                         "group receives it as JSON (nothing read from the network is "
                         "unpickled)") from None


def _generator_state(saved: Sequence[Any]) -> paddle.base.core.GeneratorState:
    """A Paddle RNG state from its JSON form (``GeneratorState.__getstate__``)."""
    state = paddle.base.core.GeneratorState.__new__(paddle.base.core.GeneratorState)
    state.__setstate__(tuple(saved))
    return state


def _pieces_of(outer_sharding: str, start_replicas: int, redundancy: int) -> int:
    """How many pieces HFSDP's optimizer state is cut into (1: HSDP, nothing cut)."""
    if outer_sharding != "optim":
        return 1
    if not isinstance(redundancy, int) or not 2 <= redundancy <= max(2, start_replicas):
        raise ValueError(
            "paddle_hsdp.ft.init(): fsdp_outer_sharding='optim' (HFSDP) needs a redundancy "
            f"(replica groups holding each piece of the optimizer state) from 2 to "
            f"start_replicas={start_replicas}, got {redundancy!r}: with 1 a dead group "
            "would take its piece along, and HFSDP would not be fault-tolerant. Use "
            "redundancy >= 2 (PADDLE_HSDP_FT_REDUNDANCY) or fsdp_outer_sharding='none'.")
    return max(1, start_replicas // redundancy)


def init(replica_id: int | None = None, coordinator: str | None = None,
         start_replicas: int | None = None, min_replicas: int = 1,
         round_timeout_s: float | None = None, max_failed_attempts: int = 10,
         redundancy: int | None = None, max_group_size: int | None = None) -> Replica:
    """Join this launch job, as one replica group, to a fault-tolerant HSDP job (after
    ``fleet.init`` with ``fsdp_outer_degree`` 1, before ``fully_shard``). Arguments
    default to the environment: ``PADDLE_HSDP_FT_REPLICA_ID`` (this group's id, stable
    across restarts), ``PADDLE_HSDP_FT_COORDINATOR`` (``host:port``),
    ``PADDLE_HSDP_FT_START_REPLICAS`` (how many groups the job starts with; the first
    step waits for them), ``PADDLE_HSDP_FT_ROUND_TIMEOUT`` (seconds, default 120) and, with
    ``fsdp_outer_sharding="optim"``, ``PADDLE_HSDP_FT_REDUNDANCY`` (how many replica
    groups hold each piece of the optimizer state, default 2: it is cut into
    ``start_replicas // redundancy`` pieces, see :mod:`paddle_hsdp.ft.pieces`) and
    ``PADDLE_HSDP_FT_MAX_GROUP_SIZE`` (the most ranks any group of the job may have, a
    multiple of this group's, the same in every group; default this group's: every
    group lays its buffers out as a group of that size, so groups of different sizes
    hold identical flat buffers)."""
    for name, hint in unknown_env_names():
        logger.warning("paddle_hsdp.ft: %s is set, but paddle_hsdp.ft reads no such "
                       "variable%s", name, hint)
    replica_id = replica_id if replica_id is not None else _int_env(REPLICA_ENV, None)
    coordinator = coordinator or os.environ.get(COORDINATOR_ENV, "")
    start = start_replicas if start_replicas is not None else _int_env(START_REPLICAS_ENV, 1)
    timeout = round_timeout_s or float_env(ROUND_TIMEOUT_ENV, 120.0)
    redundancy = redundancy if redundancy is not None else _int_env(REDUNDANCY_ENV, 2)
    if max_group_size is None and os.environ.get(MAX_GROUP_SIZE_ENV, ""):
        max_group_size = _int_env(MAX_GROUP_SIZE_ENV, None)
    return Replica(replica_id, coordinator, start, min_replicas, timeout, max_failed_attempts,
                   redundancy, max_group_size)
