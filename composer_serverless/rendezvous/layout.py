"""The store layout of one run: every key the launcher, the replicas and the CLI read or write.

Keys are relative to the run's prefix (``{store}/{run_id}``) and are spelled here only: a module that reads
or writes an object asks this one for its key, so two modules can never disagree about where something lives,
and a change of layout (a local-rank level for replicas that span several GPUs, say) is made in one place.
``describe()`` lists the layout with what each key holds; ``docs/architecture.md`` shows the same table and a
test holds the two together.

Inside a sync's prefix (``sync(k, fragment)``) the exchange works on a store rooted there, so its keys
(``sync_input``, ``sync_norm``, ``QUORUM``, ``sync_output``) are relative to that prefix. A replica of G ranks (FSDP inside
the replica) exchanges per local rank: local rank l of every replica averages its shard of the model with
local rank l of the others, under ``{l}/``; the quorum is one for all of them. States are kept per local rank
the same way. A replica of one rank has local rank 0 only.
"""

from __future__ import annotations

from typing import Any

# --- decoupled mode (diloco.mode = "decoupled": rendezvous/decoupled.py) --------------------------------

DECOUPLED = "decoupled"
CONTRIBUTIONS = f"{DECOUPLED}/contributions"
VERSIONS = f"{DECOUPLED}/versions"
GLOBALS = f"{DECOUPLED}/globals"
SYNCER_STATES = f"{DECOUPLED}/syncer"

# --- written by the launcher --------------------------------------------------------------------------

RUN_CONFIG = "run.json"
"""The resolved config; every replica reads exactly this. Written when the run is created, and again only by
a resume that changes keys a resume may change (``config/resume.py``), while no replica of the run is live."""
CONFIG_CHANGES = "config-changes.json"
"""The changes resumes made to ``run.json``: from which round on, which keys, from what to what."""
LAUNCH_RECORD = "launch.json"
"""The plan and every replica attempt's handle, so any process holding the run URL can find the replicas."""
KEY_FINGERPRINT = "key.json"
"""An authenticated run's key fingerprint (a MAC of a fixed label, which says nothing of the key), so a resume
or a replica with the wrong key is told so at once instead of rejecting every state it reads."""
MODEL = "model"
"""The model replicas load when it is not a Hub id or a directory they read (save_pretrained format): the tiny
model the launcher builds for offline runs, or a model directory on its machine uploaded for cloud replicas."""
CODE = "code"
"""The user's code for replicas that fetch it (HF Jobs), under its path relative to ``code.root``."""
CODE_MANIFEST = f"{CODE}/manifest.json"
"""Each shipped code file's sha256, written after the files: a replica checks every file against it."""
CODE_DIGESTS = "code.json"
"""Each file of the user's code the run ships, by its sha256, on every backend (those that import it in place
or build it into an image too): a resume refuses code that changed since, unless told to run it
(``code.accept_changes``), and then records the new digests here."""
INPUTS = "inputs"
"""Data files named by a path on the launcher's machine, uploaded for cloud replicas (``inputs/{slot}/``)."""
LOGS = "logs"
GIVEN_UP = "given-up"
"""Replicas the launcher gave up on (``given-up/{rank}.json``: their restart got no hardware and was cancelled):
they hold no round, whatever their last heartbeat says. Removed when the launcher starts the rank again."""
"""The local executor's replica logs (``logs/rank-{rank}.log``), when the store is a local directory."""
SUMMARY = "summary.json"
LOSS_PLOT = "loss.png"
REWARD_PLOT = "reward.png"

# --- written by the replicas --------------------------------------------------------------------------

MEMBERS = "members"
METRICS = "metrics"
ROUNDS = "rounds"
EVALS = "evals"
STATE = "state"
LATEST = f"{STATE}/LATEST"
CHECKPOINT = f"{STATE}/CHECKPOINT"
"""The newest checkpoint: a global state published with every replica's own state, where a resume starts."""
HEAL = "heal"
"""Requests for the global state of a round, from replicas that fell behind (``heal/{rank}.json``)."""
ROLLBACKS = f"{STATE}/ROLLBACKS"
"""Every time the run rolled itself back to a checkpoint (no live replica held the round the others waited
for): from which round, to which, and the states passed over. Its length is the run's rollback epoch."""
RECOVERY = "recovery"
"""Rollback claims (``recovery/{epoch}-{generation}.json``), created once: one replica rolls the run back
for all that found it stranded; kept, so that a late one never rolls it back a second time."""
INITIAL_WEIGHTS = f"{STATE}/initial.json"
REPLICAS = "replicas"
FINAL = "final"
"""The final global model and tokenizer (save_pretrained format), written by the last round's publisher."""

ROLLOUTS = "rollouts"
"""Each round's rollouts, per replica (composer runs that record them: ``composer.record_rollouts``, or a live
harvest), for the harvest to read."""

# --- written by the harvest (the launcher, with a live harvest; ``composer-serverless harvest``) ----------

HARVEST = "harvest"
HARVEST_CACHE = f"{HARVEST}/cache"
"""The run's answer cache: a teacher's answer under the hash of its endpoint, model and request body."""
HARVEST_PAIRS = f"{HARVEST}/pairs"
"""Pairs harvested live, one file per round of rollouts; the replicas take each at the round boundary the
schedule gives it (``objectives/harvest_schedule.py``)."""
HARVEST_REPORTS = f"{HARVEST}/reports"
HARVEST_SPEND = f"{HARVEST}/spend"
"""The live harvest's spend ledger, one entry per harvest: what it may have spent, recorded before each of its
requests is sent and made exact when it ends. A run's cap counts every entry, so a harvest whose report was
never written (a failed write, a killed launcher) is counted all the same."""
HARVEST_TAKEN = f"{HARVEST}/taken"
"""What each round boundary of a live harvest took: decided once, by the first replica to decide, for all."""
HARVESTER = f"{HARVEST}/harvester.json"
"""The launcher's live harvester's heartbeat: replicas stop waiting for a harvester that stopped or fell
silent."""

# --- written by the launcher's tracker relay (``tracking/relay.py``) --------------------------------------

TRACKING = "tracking"
TRACKING_RELAYED = f"{TRACKING}/relayed"
"""Per tracker, a claim for every round relayed to it (``tracking_claim``), created once before the round is
logged: the newest is the tracker's cursor, which only moves forward, and a round is logged by the one relay
that created its claim."""
TRACKING_LEASE = f"{TRACKING}/lease"
"""The relay relaying now: generations of the lease (``tracking_lease``), each created once; the newest names
its holder (or that the lease was given up), and its age by the store's clock says whether it lapsed."""
TRACKING_CLOCK = f"{TRACKING}/clock"
"""A relay's reading of the store's clock (``tracking_clock``): written, timed by the store, and removed."""
TRACKING_TENSORBOARD = f"{TRACKING}/tensorboard"
"""TensorBoard's event files, copied from the relay's directory: ``tensorboard --logdir`` reads them here."""

# Inside a sync's prefix.
SYNC_INPUTS = "in"
SYNC_OUTPUTS = "out"
SYNC_NORMS = "norm"
QUORUM = "quorum.json"

# The three objects of a snapshot (a global state or a replica's own state); the manifest is written last.
SNAPSHOT_TENSORS = "tensors.safetensors"
SNAPSHOT_STATE = "state.json"
SNAPSHOT_MANIFEST = "manifest.json"


def heartbeat(rank: int) -> str:
    """Replica ``rank``'s heartbeat, overwritten in place (object stores cannot append)."""
    return f"{MEMBERS}/{rank}.json"


def given_up(rank: int) -> str:
    """The launcher's record that it gave replica ``rank`` up: the run goes on without it."""
    return f"{GIVEN_UP}/{rank}.json"


def heal_request(rank: int) -> str:
    """Replica ``rank``'s request that the global state of a round be published (it fell behind)."""
    return f"{HEAL}/{rank}.json"


def rollback_claim(epoch: int, generation: int) -> str:
    """The claim to roll the run back from rollback epoch ``epoch``; generation g+1 is claimed only when the
    replica holding generation g did not finish in time (it died while rolling back)."""
    return f"{RECOVERY}/{epoch}-{generation}.json"


def tracking_claim(tracker: str, round_index: int) -> str:
    """The claim to log round ``round_index`` to ``tracker``, created once: its creator logs the round."""
    return f"{TRACKING_RELAYED}/{tracker}/{round_index:06d}.json"


def tracking_lease(generation: int) -> str:
    """Generation ``generation`` of the relays' lease: created once, by the relay taking the lease over from
    generation g-1 (lapsed or given up), and rewritten by that relay to renew it."""
    return f"{TRACKING_LEASE}/{generation:06d}.json"


def tracking_clock(owner: str) -> str:
    """Where relay ``owner`` reads the store's clock: the time the store gives an object it just wrote."""
    return f"{TRACKING_CLOCK}/{owner}.json"


def metrics_dir(rank: int) -> str:
    return f"{METRICS}/{rank}"


def metrics(rank: int, round_index: int) -> str:
    """Replica ``rank``'s row for round ``round_index``; zero-padded so a listing is in round order."""
    return f"{metrics_dir(rank)}/{round_index:06d}.json"


def sync(round_index: int, fragment: int) -> str:
    """The prefix of one fragment's sync in round ``round_index`` (rounds count from 1)."""
    return f"{ROUNDS}/{round_index}/{fragment}"


def sync_inputs(local: int = 0) -> str:
    return f"{local}/{SYNC_INPUTS}"


def sync_input(rank: int, shard: int, local: int = 0) -> str:
    """Relative to a sync's prefix: replica ``rank``'s pseudo-gradient shard ``shard`` of local rank
    ``local``'s part of the model."""
    return f"{sync_inputs(local)}/{rank}-{shard}"


def sync_norm(rank: int, local: int = 0) -> str:
    """Relative to a sync's prefix: the norm replica ``rank`` published for local rank ``local``'s part of its
    pseudo-gradient, the one every shard's owner judges it on (``norms.py``)."""
    return f"{local}/{SYNC_NORMS}/{rank}.json"


def sync_outputs(local: int = 0) -> str:
    return f"{local}/{SYNC_OUTPUTS}"


def sync_output(shard: int, local: int = 0) -> str:
    """Relative to a sync's prefix: the reduced (averaged) shard ``shard`` of local rank ``local``'s part."""
    return f"{sync_outputs(local)}/{shard}"


def quorum_generation(generation: int) -> str:
    """Relative to a sync's prefix: the quorum record of ``generation``. Generation 0 is ``QUORUM``; a
    later one is created only when every earlier one is unreadable (overwritten with garbage, say), so that
    one bad object cannot wedge the round: readers that find it malformed all move to the next."""
    return QUORUM if generation == 0 else f"quorum-{generation}.json"


def quorum(round_index: int, fragment: int, generation: int = 0) -> str:
    return f"{sync(round_index, fragment)}/{quorum_generation(generation)}"


def eval_share(round_index: int, part: int, parts: int) -> str:
    """A participant's share of round ``round_index``'s evaluation. The share count is in the name, so a
    share of another split of the same round (another set of participants) is never taken for this one's."""
    return f"{EVALS}/{round_index}/{part}-of-{parts}.json"


def global_state(round_index: int, local: int = 0) -> str:
    """The snapshot of local rank ``local``'s part of the global parameters and outer optimizer after round
    ``round_index``."""
    return f"{STATE}/{round_index}/{local}"


def replica_states(rank: int) -> str:
    return f"{REPLICAS}/{rank}"


def replica_state(rank: int, round_index: int, local: int = 0) -> str:
    """The snapshot of local rank ``local`` of replica ``rank``: its own state after round ``round_index`` (in
    decoupled mode, a learner's as it publishes its contribution ``round_index``)."""
    return f"{replica_states(rank)}/{round_index}/{local}"


def rollouts_dir(round_index: int) -> str:
    return f"{ROLLOUTS}/{round_index}"


def rollouts(round_index: int, rank: int) -> str:
    """Replica ``rank``'s rollouts of round ``round_index``: JSON lines {id, prompt, student, reward, task}."""
    return f"{rollouts_dir(round_index)}/{rank}.jsonl"


def cache_entry(digest: str) -> str:
    """Relative to an answer cache's root (``HARVEST_CACHE`` in a run, or the store ``harvest.cache`` names):
    the answer whose request hashes to ``digest``."""
    return f"{digest}.json"


def harvested_pairs(round_index: int) -> str:
    """The pairs a live harvest made of round ``round_index``'s rollouts; zero-padded, so a listing is in
    round order."""
    return f"{HARVEST_PAIRS}/{round_index:06d}.jsonl"


def harvest_report(round_index: int) -> str:
    """What the live harvest of round ``round_index``'s rollouts did and spent."""
    return f"{HARVEST_REPORTS}/{round_index:06d}.json"


def harvest_spend(round_index: int, attempt: str) -> str:
    """What one harvest (``attempt``) of round ``round_index``'s rollouts may have spent."""
    return f"{HARVEST_SPEND}/{round_index:06d}-{attempt}.json"


def harvest_taken(round_index: int) -> str:
    """Which harvested pair files the replicas take at the end of round ``round_index`` (create-if-absent: the
    first replica to decide decides for every replica)."""
    return f"{HARVEST_TAKEN}/{round_index:06d}.json"


def contributions(learner: int) -> str:
    return f"{CONTRIBUTIONS}/{learner}"


def contribution(learner: int, seq: int) -> str:
    """Learner ``learner``'s ``seq``-th pseudo-gradient (0-based), created once; zero-padded, so a listing is
    in the learner's order."""
    return f"{contributions(learner)}/{seq:08d}"


def contribution_part(learner: int, seq: int, attempt: str, fragment: int) -> str:
    """With a sharded syncer (``diloco.decoupled.syncer_shards`` > 1): fragment ``fragment`` of one attempt
    at contribution ``seq``, written before the contribution's own object (``contribution``), which names the
    attempt: a learner that dies between its parts leaves no contribution, and a redo's parts never mix with
    a dead attempt's. Beside the contribution, so consuming its sequence number prunes both."""
    return f"{contribution(learner, seq)}-{attempt}-{fragment}"


def version_plan(v: int) -> str:
    """With a sharded syncer: what the merge of version ``v`` takes (created once by shard 0), which every
    shard then merges its fragment of."""
    return f"{VERSIONS}/{v:08d}.plan.json"


def version_part(v: int, fragment: int) -> str:
    """With a sharded syncer: shard ``fragment``'s record of its part of version ``v`` (its snapshots' writer,
    what it merged and dropped), created once after its snapshots; ``version(v)`` follows once every part's
    exists."""
    return f"{VERSIONS}/{v:08d}.part-{fragment}.json"


def version(v: int) -> str:
    """The record of global version ``v``: which snapshots hold it and what its merge took; created once,
    after them, so a version exists only whole and only one syncer's merge of it ever does."""
    return f"{VERSIONS}/{v:08d}.json"


def global_params(v: int, writer: str) -> str:
    """Global version ``v``'s parameters as ``writer`` (one syncer process's token) wrote them: a syncer
    that loses the creation of ``version(v)`` leaves its own beside the winner's, never over them."""
    return f"{GLOBALS}/{v:08d}-{writer}"


def syncer_state(v: int, writer: str) -> str:
    """The syncer's outer optimizer state after version ``v``, as ``writer`` wrote it."""
    return f"{SYNCER_STATES}/{v:08d}-{writer}"


def snapshot_file(prefix: str, name: str) -> str:
    return f"{prefix}/{name}"


class _Placeholder(str):
    """A key argument shown as ``{name}`` whatever format it is given (``{k:06d}`` too)."""

    def __format__(self, spec: str) -> str:
        return "{" + str.__str__(self) + "}"


def describe() -> list[tuple[str, str]]:
    """The layout as (key pattern, what it holds), for the documentation; prefixes end in ``/``."""
    placeholder: Any = _Placeholder  # stands in for the int arguments
    rank, k, frag, shard, part, parts, local = map(
        placeholder, ("rank", "k", "frag", "s", "part", "parts", "local")
    )
    in_sync = f"{sync(k, frag)}/"
    return [
        (RUN_CONFIG, "resolved config, written by the launcher (again only by a resume with --set)"),
        (CONFIG_CHANGES, "what each resume with --set changed in run.json, and from which round"),
        (LAUNCH_RECORD, "the plan and every replica attempt's handle (the launcher)"),
        (KEY_FINGERPRINT, "the run key's fingerprint, created once (diloco.authenticate)"),
        (
            f"{MODEL}/",
            "the tiny model the launcher builds, or a local model directory uploaded for cloud replicas",
        ),
        (f"{CODE}/", "the user's code, for replicas that fetch it (HF Jobs)"),
        (CODE_MANIFEST, "each code file's sha256, written after them"),
        (CODE_DIGESTS, "each user code file's sha256 on every backend, for a resume to compare"),
        (f"{INPUTS}/", "data files named by a local path, uploaded for cloud replicas"),
        (heartbeat(rank), "heartbeat: state, round, step, the last step's loss (and reward)"),
        (given_up(rank), "the launcher gave the replica up (no hardware): it holds no round"),
        (metrics(rank, k), "one row per round, with a row per inner step (object stores cannot append)"),
        (in_sync + sync_input(rank, shard, local), "pseudo-gradient shards of local rank {local}'s part"),
        (in_sync + sync_norm(rank, local), "the norm of that part the outlier rule judges, created once"),
        (in_sync + QUORUM, "participants of the sync, created once"),
        (
            in_sync + quorum_generation(placeholder("g")),
            "the quorum again, if every earlier one is unreadable",
        ),
        (in_sync + sync_output(shard, local), "reduced shards, created once"),
        (eval_share(k, part, parts), "a participant's share of round k's evaluation"),
        (INITIAL_WEIGHTS, "sha256 of the initial weights, created once"),
        (f"{global_state(k, local)}/", "global params + outer optimizer state + manifest, per local rank"),
        (LATEST, "the newest complete state"),
        (
            CHECKPOINT,
            "the newest checkpoint (every checkpoint_every rounds), and the older ones kept: where a resume starts",
        ),
        (heal_request(rank), "a lagging replica's request that the round it waits for be published"),
        (ROLLBACKS, "the rollbacks the run made by itself: from which round, to which"),
        (
            rollback_claim(placeholder("epoch"), placeholder("g")),
            "a replica's claim to roll the run back, created once",
        ),
        (
            f"{replica_state(rank, k, local)}/",
            "inner optimizer, schedule, RNG, data position, per local rank (decoupled: k is a contribution)",
        ),
        (rollouts(k, rank), "a replica's rollouts of round k: prompt, completion, reward (when recorded)"),
        (
            f"{HARVEST_CACHE}/{cache_entry(placeholder('digest'))}",
            "a teacher's answer under the hash of its endpoint, model and request",
        ),
        (harvested_pairs(k), "pairs a live harvest made of round k's rollouts"),
        (
            harvest_report(k),
            "that harvest's requests, latency, tokens and USD per teacher, or why it made none",
        ),
        (
            harvest_spend(k, placeholder("attempt")),
            "what one harvest of round k may have spent: recorded before each request, exact at its end",
        ),
        (harvest_taken(k), "the pair files the replicas take at the end of round k, created once"),
        (HARVESTER, "the launcher's live harvester's heartbeat: what it does, or that it stopped"),
        (
            tracking_claim(placeholder("tracker"), k),
            "a relay's claim to log round k to a tracker, created once before it logs it",
        ),
        (tracking_lease(placeholder("g")), "generation g of the relays' lease: who holds it, created once"),
        (tracking_clock(placeholder("owner")), "a relay's reading of the store's clock, removed at once"),
        (f"{TRACKING_TENSORBOARD}/", "TensorBoard event files of the run's tracker run"),
        (
            contribution(rank, placeholder("seq")),
            "decoupled: a learner's pseudo-gradient and its base version",
        ),
        (version(placeholder("v")), "decoupled: global version v, what its merge took, created once"),
        (
            f"{global_params(placeholder('v'), placeholder('writer'))}/",
            "decoupled: global version v's parameters + manifest",
        ),
        (
            f"{syncer_state(placeholder('v'), placeholder('writer'))}/",
            "decoupled: the syncer's outer optimizer state after version v",
        ),
        (f"{FINAL}/", "the final global model and tokenizer (Hugging Face format)"),
        (SUMMARY, "the report's figures, written at the end"),
        (LOSS_PLOT, "held-out and training loss per round"),
        (REWARD_PLOT, "held-out reward and loss channels per round (composer runs)"),
        (f"{LOGS}/", "local replicas' logs, when the store is a directory"),
    ]
