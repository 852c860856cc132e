------------------------------- MODULE OmniSleep -------------------------------
(***************************************************************************)
(* The sleep/wake protocol of one omni-core stage: an orchestrator (the    *)
(* StageCore), a set of worker ranks (WorkerCore), and a network that may  *)
(* duplicate, reorder (a set has no order), corrupt and lose messages;     *)
(* ranks may crash and backends may raise.                                 *)
(*                                                                         *)
(* Every legality check and next state of a worker or stage comes from the *)
(* GENERATED module OmniTransitions (omni_core/fsm's tables), never from a *)
(* second table written here. What this module adds is what the tables    *)
(* leave to the cores: reply cache, epoch fence, all-ranks commit, ALREADY *)
(* no-ops, residency of tags, deadlines, the drain before a sleep.         *)
(*                                                                         *)
(* Invariants are named after the MUSTs of specs/protocol.md (P-1..P-11).  *)
(* `Bug` selects a variant with one known defect (tla/bugs/*.cfg): each    *)
(* must be rejected by TLC with the invariant it breaks.                   *)
(*                                                                         *)
(* Abstractions: tags are the constant Tags (models: DefaultTags, the      *)
(* tables' default; a trace: its stage's); task ids are 1..MaxTask,        *)
(* unique per call (the caller's idempotency key); Status and Shutdown are *)
(* not modelled (they never change residency); Restart happens from every *)
(* state the stage table allows it and replaces every rank by a fresh      *)
(* process under epoch + 1, killing the live ones. The                     *)
(* reply cache is unbounded (the real one evicts after 1024 tasks).        *)
(*                                                                         *)
(* Requests: up to MaxRequests Execute requests are in flight at once (the *)
(* engine's max_in_flight), each sent to every rank. A request ends only   *)
(* when every rank has answered it, and a rank silent on a request fails   *)
(* the stage: ending it earlier lets a drain release a Sleep while another *)
(* rank still executes (bug model early_request_finish). A sleep's Sleep   *)
(* goes out only once no request is in flight (bug models no_drain,        *)
(* drain_one_request).                                                     *)
(*                                                                         *)
(* Start-up: a rank loads (Hello ACTIVE) or its runner or backend raises   *)
(* while loading (a fault of kind "error": Hello FAILED); once every rank  *)
(* has said Hello, a stage with a FAILED one goes FAILED naming those.     *)
(***************************************************************************)
EXTENDS Naturals, FiniteSets, TLC, OmniTransitions

CONSTANTS
    Ranks,          \* the stage's ranks (model values)
    MaxTask,        \* the orchestrator issues task ids 1..MaxTask (commands and requests)
    MaxEpoch,       \* epochs 0..MaxEpoch; each Restart adds one
    Faults,         \* SUBSET {"dup", "drop", "corrupt", "crash", "error", "timeout", "badsource", "short", "kill",
                    \*         "nomemory"}
    MaxFaults,      \* at most this many dup/drop/corrupt/crash/error events per behaviour
    Tags,           \* the stage's tags (StageSpec.tags): strings; "weights" is the one a sleep keeps
    SleepLevels,    \* SUBSET {1, 2}: levels of the sleep() calls the orchestrator may make
    SleepTags,      \* SUBSET ({"all"} \cup Tags): their tags ("all": tags=None)
    WakeTags,       \* SUBSET ({"all"} \cup Tags): the wake() calls it may make
    Requests,       \* TRUE: it also issues Execute requests (admission)
    MaxRequests,    \* at most this many requests in flight at once (max_in_flight)
    SerialShell,    \* TRUE: a rank takes its next message only after its effect ended
    Profiles,       \* TRUE: the orchestrator also starts and stops the ranks' profilers (P-15)
    Bug             \* "none" or the defect of a bug model (see BugNames)

(* Each bug model carries one known defect:
     no_reply_cache          a duplicate command is executed again (P-2)
     commit_before_all_acks  the stage commits on the first ACK (P-5)
     execute_in_partial      the tables admit Execute in PARTIAL (P-7)
     no_epoch_fence          workers accept commands of an older epoch (P-6)
     busy_unrecorded         a BUSY refusal of an Execute is not recorded: with an asynchronous
                             shell a copy runs after the refusal (P-1)
     busy_before_cache       the skeleton's WorkerCore: BUSY checked before the reply cache,
                             so an answered task gets a second verdict (P-1)
     execute_in_needs_reload the tables admit Execute in NEEDS_RELOAD (P-8)
     no_drain                sleep() sends Sleep while requests are in flight (P-7)
     drain_one_request       the drain waits for one request only: the Sleep goes out when
                             any request ends, though others are still in flight (P-7)
     early_request_finish    a request ends on its first NACK or at its deadline while other
                             ranks may still execute it (P-7)
     no_deadline             the orchestrator has no deadlines (P-9: a lost reply hangs)
     forget_invalidation     Residency forgets that a level-2 discard invalidates the weights,
                             in the worker and the stage alike (the cores agree on the lie):
                             requests run on discarded weights (P-8 over memory, Mem)
     no_ack_check            the stage commits on ACKs whose state or asleep tags disagree with
                             what it expects; with "short" in Faults a rank ACKs truthfully a
                             wake that restored less than asked (P-7 over memory)
     already_untrue          the stage answers a wake ALREADY without checking that its tags are
                             resident (P-4 over memory: AlreadyUntrue)
     commit_beside_no_memory the stage commits a waiting wake that some ranks refused
                             NO_MEMORY because the others ACKed: its ranks then hold different
                             tags (P-5: a commit needs every rank's ACK)
   and two of the admission queue (OmniAdmission.tla, which extends this module):
     queue_unbounded         a request is queued even when the queue is at its limit
     queue_dropped_on_wake   the dispatch after a wake sends the queue's first request and
                             drops the others unanswered
     queue_refused_anywhere  the pump refuses the queue wherever it runs, where it should
                             dispatch too (Adm_QueueRefusedOnlyByARule)
   and two of the pause (OmniPause.tla, which extends OmniAdmission):
     pause_no_drain          the pause commits PAUSED with requests still in flight
     pause_admits            a request sent to the ranks of a PAUSED stage *)
BugNames == {"none", "no_reply_cache", "commit_before_all_acks", "execute_in_partial",
             "no_epoch_fence", "busy_before_cache", "busy_unrecorded", "execute_in_needs_reload", "no_drain",
             "drain_one_request", "early_request_finish", "no_deadline", "forget_invalidation",
             "no_ack_check", "queue_unbounded", "queue_dropped_on_wake", "commit_beside_no_memory",
             "already_untrue", "queue_refused_anywhere", "pause_no_drain", "pause_admits", "pause_wake_resumes"}

ASSUME Bug \in BugNames
ASSUME Faults \subseteq {"dup", "drop", "corrupt", "crash", "error", "timeout", "badsource", "short", "kill",
                         "nomemory"}
ASSUME SleepLevels \subseteq {1, 2}
ASSUME Tags # {} /\ "all" \notin Tags
ASSUME SleepTags \cup WakeTags \subseteq {"all"} \cup Tags
ASSUME MaxTask \in Nat /\ MaxEpoch \in Nat /\ MaxFaults \in Nat /\ MaxRequests \in Nat
ASSUME SerialShell \in BOOLEAN /\ Profiles \in BOOLEAN

Weights == "weights"
Version == 1
TagSet(name) == IF name = "all" THEN Tags ELSE {name}
TaskIds == 1..MaxTask
Epochs == 0..MaxEpoch
NoVal == "-"

Settled == {"RUNNING", "SLEEPING", "PARTIAL", "NEEDS_RELOAD"}     \* _SERVING in fsm/stage.py
InTask == {"DRAINING", "TRANSITIONING", "WAKING"}                  \* _IN_TASK
Transient == {"OFFLOADING", "RESTORING", "RELOADING"}

ASSUME Settled \cup InTask \subseteq StageStates /\ Transient \subseteq WorkerStates

(* The relation the cores run: the generated table, plus the one row a bug model adds. *)
BugRow(s, g) == \/ Bug = "execute_in_partial" /\ g = "execute" /\ s = "PARTIAL"
                \/ Bug = "execute_in_needs_reload" /\ g = "execute" /\ s = "NEEDS_RELOAD"
WLegal(s, g) == WorkerLegal(s, g) \/ BugRow(s, g)
SLegal(s, g) == StageLegal(s, g) \/ BugRow(s, g)
(* Firing a trigger the table does not allow stops TLC with an error, so the spec can
   never step outside the generated relation (a bug model's extra row is internal). *)
Forbidden(who, s, g) == Assert(FALSE, <<who, "fires a trigger its table forbids", s, g>>)
WNext(s, g) == IF WorkerLegal(s, g) THEN WorkerNext(s, g)
               ELSE IF BugRow(s, g) \/ Forbidden("worker", s, g) THEN s ELSE s
SNext(s, g) == IF StageLegal(s, g) THEN StageNext(s, g)
               ELSE IF BugRow(s, g) \/ Forbidden("stage", s, g) THEN s ELSE s

(* Residency.settled() in fsm/tags.py *)
Settle(asleep, valid) ==
    IF asleep = {} /\ valid THEN "active"
    ELSE IF Weights \notin asleep /\ ~valid THEN "needs_reload"
    ELSE "partial"

\* RankState, Restored, Reloaded and WakeCommit (what each settled outcome means for the
\* ranks and the stage) come from the generated module: fsm/settle.py's SETTLE_ROWS.
StageOfRank(s) == CASE s = "ACTIVE" -> "RUNNING" [] s = "SLEEPING" -> "SLEEPING"
                    [] s = "PARTIAL" -> "PARTIAL" [] s = "NEEDS_RELOAD" -> "NEEDS_RELOAD"
                    [] OTHER -> NoVal

(* ---- messages: one record shape for all, so that sets of them compare. task 0 is "-". *)
Msg(kind, type, t, e, r, lvl, tg, st, asl, info) ==
    [v |-> Version, kind |-> kind, type |-> type, task |-> t, epoch |-> e, rank |-> r,
     level |-> lvl, tags |-> tg, state |-> st, asleep |-> asl, info |-> info]
CmdMsg(type, t, e, r, lvl, tg) == Msg("cmd", type, t, e, r, lvl, tg, NoVal, {}, NoVal)
AckMsg(type, t, e, r, st, asl, status) == Msg("ack", type, t, e, r, 0, {}, st, asl, status)
NackMsg(type, t, e, r, reason, st) == Msg("nack", type, t, e, r, 0, {}, st, {}, reason)
ResultMsg(t, e, r) == Msg("result", "Execute", t, e, r, 0, {}, NoVal, {}, NoVal)
HelloMsg(e, r, st) == Msg("hello", "Hello", 0, e, r, 0, {}, st, {}, NoVal)
BadBytes(r) == Msg("bad", NoVal, 0, 0, r, 0, {}, NoVal, {}, NoVal)
NoMsg == Msg("none", NoVal, 0, 0, NoVal, 0, {}, NoVal, {}, NoVal)
ReplyKinds == {"ack", "nack", "result"}

NoPend == [task |-> 0, type |-> NoVal, level |-> 0, plan |-> {}, offload |-> {}]
NoReplies == [t \in TaskIds |-> {}]
NoErrors == [t \in TaskIds |-> FALSE]
NoCmd == [type |-> NoVal, level |-> 0, tags |-> {}]
NoProf == [said |-> {}, nacks |-> {}]
(* Profile on the wire: level 1 is a start, level 0 a stop (the prefix is not modelled: a
   refused prefix is a refusal without effect, which P11 covers). *)
ProfileStart(lvl) == lvl = 1
(* The state a rank of a settled stage is in (the inverse of StageOfRank). *)
RankOfStage(s) == CASE s = "RUNNING" -> "ACTIVE" [] s = "SLEEPING" -> "SLEEPING"
                    [] s = "PARTIAL" -> "PARTIAL" [] s = "NEEDS_RELOAD" -> "NEEDS_RELOAD"
                    [] OTHER -> NoVal

(* ---- ghost memory: what each rank's device memory holds per tag, moved only by the
   memory effects the shell performs (SleepEffect's offload/discard, WakeEffect's tags, a
   reload), never by the cores' bookkeeping (wasleep, wvalid). The abstract memory spec
   OmniMemory.tla says which moves exist; MemoryRefined checks that this spec refines it.
     "valid"    mapped, content usable (weights: the model's values; scratch: mapped at all)
     "host"     unmapped, a valid host copy waits (an offloaded weights tag)
     "lost"     unmapped, no copy (discarded)
     "garbage"  mapped again after a discard: weights that hold no model values until reloaded
   Scratch tags (kv_cache) hold nothing to preserve, so mapped scratch is "valid": with that,
   in a correct model mem is a function of (wasleep, wvalid) and adds no distinct states. *)
MemValues == {"valid", "host", "lost", "garbage"}
FreshMem == [t \in Tags |-> "valid"]
(* plan_sleep in fsm/tags.py: the tags a sleep offloads; the rest of its plan is discarded.
   Carried on the pending effect as SleepEffect carries it (checked against plan_sleep by
   the agreement check, formal/agree.py). *)
SleepOffload(level, plan, valid) == IF level = 1 /\ valid THEN plan \cap {Weights} ELSE {}
(* The memory a set of tags holds, seen from bookkeeping: CarriedInit of the trace spec. *)
MemFrom(asleep, valid) ==
    [t \in Tags |-> IF t = Weights
                    THEN IF t \in asleep THEN (IF valid THEN "host" ELSE "lost")
                         ELSE (IF valid THEN "valid" ELSE "garbage")
                    ELSE IF t \in asleep THEN "lost" ELSE "valid"]

VARIABLES
    \* worker ranks (WorkerCore), one entry per rank
    mem,        \* ghost: what device memory holds, per rank and tag (MemValues)
    wstate, alive, wasleep, wvalid, wepoch, wpend,
    wprof,      \* the rank's profiler runs (P-15): orthogonal to its state
    wcache,     \* reply cache: terminal replies by task (P-2)
    replied,    \* history: terminal replies this process sent (P-1)
    applied,    \* history: how often each rank started the effect of each task (P-2)
    \* orchestrator (StageCore)
    sstate, sepoch,
    stask, scmd,          \* the lifecycle task in flight (0 / NoCmd when none)
    sacks,                \* ranks whose ACK (or Hello) the current or last commit counted (P-5)
    sloadFailed,          \* while STARTING: the ranks whose Hello said FAILED
    sasleep, svalid,      \* the stage's view of its ranks' residency
    sreqs,                \* the Execute requests in flight (task ids)
    sreqReplies, sreqErr, \* per request task: ranks that answered it, whether one refused
    failedRanks,          \* the ranks a FAILED stage names (P-9)
    sprof,                \* the Profile task in flight: ranks that answered it, ranks that refused
                          \* (a waiting Wake's NO_MEMORY refusals too: no Profile runs meanwhile)
    outcome,              \* per task: "none", "pending", "ok", "failed"
    nextTask,
    net, faults,
    broken      \* history: the action-level MUSTs an action broke (empty unless a bug)

workerVars == <<mem, wstate, alive, wasleep, wvalid, wepoch, wpend, wprof, wcache, replied, applied>>
stageVars == <<sstate, sepoch, stask, scmd, sacks, sloadFailed, sasleep, svalid, sreqs, sreqReplies,
               sreqErr, failedRanks, outcome, sprof>>
vars == <<workerVars, stageVars, nextTask, net, faults, broken>>

FreshWorkers(e) ==
    /\ mem' = [r \in Ranks |-> FreshMem]
    /\ wstate' = [r \in Ranks |-> WorkerInitial]
    /\ alive' = [r \in Ranks |-> TRUE]
    /\ wasleep' = [r \in Ranks |-> {}]
    /\ wvalid' = [r \in Ranks |-> TRUE]
    /\ wepoch' = [r \in Ranks |-> e]
    /\ wpend' = [r \in Ranks |-> NoPend]
    /\ wprof' = [r \in Ranks |-> FALSE]
    /\ wcache' = [r \in Ranks |-> {}]
    /\ replied' = [r \in Ranks |-> {}]

Init ==
    /\ mem = [r \in Ranks |-> FreshMem]
    /\ wstate = [r \in Ranks |-> WorkerInitial]
    /\ alive = [r \in Ranks |-> TRUE]
    /\ wasleep = [r \in Ranks |-> {}]
    /\ wvalid = [r \in Ranks |-> TRUE]
    /\ wepoch = [r \in Ranks |-> 0]
    /\ wpend = [r \in Ranks |-> NoPend]
    /\ wprof = [r \in Ranks |-> FALSE]
    /\ wcache = [r \in Ranks |-> {}]
    /\ replied = [r \in Ranks |-> {}]
    /\ applied = [r \in Ranks |-> [t \in TaskIds |-> 0]]
    /\ sstate = StageInitial
    /\ sepoch = 0
    /\ stask = 0
    /\ scmd = NoCmd
    /\ sacks = {}
    /\ sloadFailed = {}
    /\ sasleep = {}
    /\ svalid = TRUE
    /\ sreqs = {}
    /\ sreqReplies = NoReplies
    /\ sreqErr = NoErrors
    /\ failedRanks = {}
    /\ sprof = NoProf
    /\ outcome = [t \in TaskIds |-> "none"]
    /\ nextTask = 1
    /\ net = {}
    /\ faults = 0
    /\ broken = {}

FaultOk(kind) == kind \in Faults /\ faults < MaxFaults

-----------------------------------------------------------------------------
(* ================================ worker ================================ *)
(* WorkerCore.step(CommandReceived): the result of one command as a record *)
(*   st: next state, pend: pending effect, reply: reply to send (NoMsg),     *)
(*   cache: put the reply in the reply cache, apply: an effect started.      *)

Out(r, st, pend, reply, cache, apply) ==
    [st |-> st, pend |-> pend, reply |-> reply, cache |-> cache, apply |-> apply]
Silent(r) == Out(r, wstate[r], wpend[r], NoMsg, FALSE, FALSE)
Refuse(r, m, reason) ==      \* refusals are not cached: they had no effect
    Out(r, wstate[r], wpend[r], NackMsg(m.type, m.task, m.epoch, r, reason, wstate[r]), FALSE, FALSE)
RefuseRecorded(r, m, reason) ==   \* a refusal the stage takes as the answer: kept, so a copy gets it too
    Out(r, wstate[r], wpend[r], NackMsg(m.type, m.task, m.epoch, r, reason, wstate[r]), TRUE, FALSE)
Already(r, m, g) ==
    Out(r, WNext(wstate[r], g), wpend[r],
        AckMsg(m.type, m.task, wepoch[r], r, WNext(wstate[r], g), wasleep[r], "ALREADY"), TRUE, FALSE)
(* "nomemory": a Wake may wait for free memory (P-16; level 1 on the wire) and be refused NO_MEMORY, back where it
   came from, kept in the wake's level, 2..4, -2..-4 in scmd for a plain wake (wpend and scmd keep their shapes). *)
WaitLevel(s) == CASE s = "SLEEPING" -> 2 [] s = "PARTIAL" -> 3 [] OTHER -> 4
FromLevel(level) == IF level > 0 THEN level ELSE 0 - level   \* a plain wake keeps -WaitLevel: it may be refused too
RefusedWake(level) == CASE level = 2 -> "wake_refused_sleeping"
                        [] level = 3 -> "wake_refused_partial"
                        [] OTHER -> "wake_refused_needs_reload"
WakeWaits == IF "nomemory" \in Faults THEN {0, 1} ELSE {0}

Start(r, m, g, plan, offload) ==
    Out(r, WNext(wstate[r], g),
        [task |-> m.task, type |-> m.type, plan |-> plan, offload |-> offload,
         level |-> IF m.type = "Wake" /\ m.level = 1 THEN WaitLevel(wstate[r]) ELSE m.level],
        NoMsg, FALSE, TRUE)
Cached(r, t) == \E c \in wcache[r] : c.task = t
FromCache(r, m) == Out(r, wstate[r], wpend[r], CHOOSE c \in wcache[r] : c.task = m.task, FALSE, FALSE)

OnSleep(r, m) ==
    LET toSleep == m.tags \ wasleep[r] IN
    IF toSleep = {} /\ WLegal(wstate[r], "sleep_already") THEN Already(r, m, "sleep_already")
    ELSE IF ~WLegal(wstate[r], "sleep") THEN Refuse(r, m, "INVALID_STATE")
    ELSE Start(r, m, "sleep", toSleep, SleepOffload(m.level, toSleep, wvalid[r]))

OnWake(r, m) ==
    LET toWake == m.tags \cap wasleep[r] IN
    IF toWake = {} /\ WLegal(wstate[r], "wake_already") THEN Already(r, m, "wake_already")
    ELSE IF ~WLegal(wstate[r], "wake") THEN Refuse(r, m, "INVALID_STATE")
    ELSE Start(r, m, "wake", toWake, {})

OnReload(r, m) ==
    IF ~WLegal(wstate[r], "reload") THEN Refuse(r, m, "INVALID_STATE") ELSE Start(r, m, "reload", {}, {})

OnExecute(r, m) ==
    IF ~WLegal(wstate[r], "execute") THEN Refuse(r, m, "INVALID_STATE") ELSE Start(r, m, "execute", {}, {})

(* WorkerCore._on_profile: a start while the profiler runs, or a stop while it does not, is
   ALREADY; otherwise an effect on the profiler alone, legal where the table says (P-15). *)
OnProfile(r, m) ==
    IF ProfileStart(m.level) = wprof[r] /\ WLegal(wstate[r], "profile_already")
    THEN Already(r, m, "profile_already")
    ELSE IF ~WLegal(wstate[r], "profile") THEN Refuse(r, m, "INVALID_STATE")
    ELSE Start(r, m, "profile", {}, {})

Busy(r) == wpend[r] # NoPend
(* P-13: a worker refuses a command more than this many epochs ahead of its own (EPOCH_AHEAD),
   its epoch unchanged. The protocol's number, written here and not generated from the code,
   so that a worker core with another window disagrees (formal/agree.py); the models' epochs
   stay far below it, so no model's state count depends on it. *)
MaxEpochAhead == 64

OnCommand(r, m) ==
    IF m.kind = "bad" THEN      \* P-10: refuse the bytes, keep serving
        Out(r, wstate[r], wpend[r], NackMsg(NoVal, 0, wepoch[r], r, "BAD_MESSAGE", wstate[r]),
            FALSE, FALSE)
    ELSE IF m.epoch < wepoch[r] /\ Bug # "no_epoch_fence" THEN Refuse(r, m, "STALE_EPOCH")
    ELSE IF m.epoch > wepoch[r] + MaxEpochAhead THEN Refuse(r, m, "EPOCH_AHEAD")   \* P-13
    ELSE IF wpend[r].task = m.task THEN Silent(r)     \* the terminal reply follows on Done (P-1)
    ELSE IF Busy(r) /\ Bug = "busy_before_cache" THEN Refuse(r, m, "BUSY")
    ELSE IF Cached(r, m.task) /\ Bug # "no_reply_cache" THEN FromCache(r, m)
    ELSE IF Busy(r) /\ m.type \in {"Execute", "Profile"} /\ Bug # "busy_unrecorded"   \* the stage's answer
    THEN RefuseRecorded(r, m, "BUSY")
    ELSE IF Busy(r) THEN Refuse(r, m, "BUSY")
    ELSE IF wstate[r] = "FAILED" THEN Refuse(r, m, "FAILED")
    ELSE CASE m.type = "Sleep" -> OnSleep(r, m)
           [] m.type = "Wake" -> OnWake(r, m)
           [] m.type = "ReloadWeights" -> OnReload(r, m)
           [] m.type = "Execute" -> OnExecute(r, m)
           [] m.type = "Profile" -> OnProfile(r, m)

Terminal(m) == m.kind \in ReplyKinds /\ m.task # 0

(* SerialShell: the shell takes the next message only once the effect it performs has
   ended, as WorkerProcess does (it performs each effect before it reads the socket again);
   otherwise a message may arrive mid-effect, as the cores allow (an asynchronous shell). *)
WorkerReceive(r, m, keep) ==
    /\ m.kind \in {"cmd", "bad"} /\ m.rank = r /\ alive[r]
    /\ SerialShell => ~Busy(r)
    /\ keep => FaultOk("dup")
    /\ LET o == OnCommand(r, m)
           changed == o.st # wstate[r] \/ o.pend # wpend[r]   \* receiving never moves memory
           stale == m.kind = "cmd" /\ m.epoch < wepoch[r]
       IN /\ wstate' = [wstate EXCEPT ![r] = o.st]
          /\ wpend' = [wpend EXCEPT ![r] = o.pend]
          /\ wcache' = IF o.cache THEN [wcache EXCEPT ![r] = @ \cup {o.reply}] ELSE wcache
          /\ replied' = IF Terminal(o.reply) THEN [replied EXCEPT ![r] = @ \cup {o.reply}]
                        ELSE replied
          /\ applied' = IF o.apply THEN [applied EXCEPT ![r][m.task] = @ + 1] ELSE applied
          /\ net' = (IF keep THEN net ELSE net \ {m})
                    \cup (IF o.reply.kind = "none" THEN {} ELSE {o.reply})
          /\ broken' = broken
                \cup (IF stale /\ (changed \/ o.reply.info # "STALE_EPOCH") THEN {"P6"} ELSE {})
                \cup (IF m.kind = "bad" /\ (changed \/ o.reply.info # "BAD_MESSAGE")
                      THEN {"P10"} ELSE {})
                \cup (IF \/ o.reply.info = "ALREADY" /\ changed
                         \/ o.apply /\ m.type = "Sleep" /\ m.tags \subseteq wasleep[r]
                         \/ o.apply /\ m.type = "Wake" /\ m.tags \cap wasleep[r] = {}
                      THEN {"P4"} ELSE {})
                \cup (IF o.reply.kind = "nack" /\ changed THEN {"P11"} ELSE {})
                \cup (IF m.type = "Profile" /\ o.st # wstate[r] THEN {"P15"} ELSE {})
    /\ faults' = IF keep THEN faults + 1 ELSE faults
    /\ UNCHANGED <<mem, alive, wasleep, wvalid, wepoch, wprof, stageVars, nextTask>>

(* The effect was refused before it changed anything: EffectDeclined. The runner refused
   the reload's source before writing (NACK INVALID_ARGUMENT), or a waiting wake found too little
   free memory in time and unmapped what it had mapped (NACK NO_MEMORY; memory as before): back
   to the state the command came from; the answer is cached like any terminal reply of an
   attempted effect, so a copy of the task gets it again (P-2). A waiting wake may also finish. *)
BadSourcePending(r) == wpend[r].type = "ReloadWeights" /\ wpend[r].level = 1
NoMemoryPossible(r) == wpend[r].type = "Wake" /\ wpend[r].level > 0 /\ "nomemory" \in Faults
Refused(r) ==
    /\ alive[r] /\ Busy(r) /\ (BadSourcePending(r) \/ NoMemoryPossible(r))
    /\ LET p == wpend[r]
           wake == p.type = "Wake"
           st == WNext(wstate[r], IF wake THEN RefusedWake(p.level)
                                  ELSE IF wvalid[r] THEN "reload_refused_active" ELSE "reload_refused_needs_reload")
           reply == NackMsg(p.type, p.task, wepoch[r], r, IF wake THEN "NO_MEMORY" ELSE "INVALID_ARGUMENT", st)
       IN /\ wstate' = [wstate EXCEPT ![r] = st]
          /\ wpend' = [wpend EXCEPT ![r] = NoPend]
          /\ wcache' = [wcache EXCEPT ![r] = @ \cup {reply}]
          /\ replied' = [replied EXCEPT ![r] = @ \cup {reply}]
          /\ net' = net \cup {reply}
    /\ UNCHANGED <<mem, alive, wasleep, wvalid, wepoch, wprof, applied, stageVars, nextTask, faults, broken>>

(* What the memory effect of p does to one tag holding `held` (ghost): a sleep offloads
   p.offload and discards the rest of its plan; a wake maps `did` back, restoring a host copy
   and leaving discarded weights garbage; a reload writes the weights. *)
MemAfter(p, did, t, held) ==
    CASE p.type = "Sleep" /\ t \in p.offload -> "host"
      [] p.type = "Sleep" /\ t \in p.plan -> "lost"
      [] p.type = "Wake" /\ t \in did -> (IF held = "host" \/ t # Weights THEN "valid" ELSE "garbage")
      [] p.type = "ReloadWeights" /\ t = Weights -> "valid"
      [] OTHER -> held

(* The shell performed the pending effect: EffectCompleted. With "short" in Faults a wake
   may map back less than its plan (a backend that could not map one pool) and the worker
   ACKs what it holds: an ACK that disagrees with what the stage expects. *)
DoneSets(r) == IF wpend[r].type = "Wake" /\ FaultOk("short")
               THEN {d \in SUBSET wpend[r].plan : d # {}}
               ELSE {wpend[r].plan}
Done(r) ==
    /\ alive[r] /\ Busy(r) /\ ~BadSourcePending(r)
    /\ \E did \in DoneSets(r) :
       LET p == wpend[r]
           asl == CASE p.type = "Sleep" -> wasleep[r] \cup p.plan
                    [] p.type = "Wake" -> wasleep[r] \ did
                    [] OTHER -> wasleep[r]
           val == CASE p.type = "Sleep" -> wvalid[r] /\ ~(p.level = 2 /\ Weights \in p.plan
                                                           /\ Bug # "forget_invalidation")
                    [] p.type = "ReloadWeights" -> TRUE
                    [] OTHER -> wvalid[r]
           g == CASE p.type = "Sleep" -> "offloaded"
                  [] p.type = "Wake" -> Restored[Settle(asl, val)]
                  [] p.type = "ReloadWeights" -> Reloaded[Settle(asl, val)]
                  [] OTHER -> "execute"
           st == IF p.type \in {"Execute", "Profile"} THEN wstate[r] ELSE WNext(wstate[r], g)
           reply == IF p.type = "Execute" THEN ResultMsg(p.task, wepoch[r], r)
                    ELSE AckMsg(p.type, p.task, wepoch[r], r, st, asl, "OK")
       IN /\ wstate' = [wstate EXCEPT ![r] = st]
          /\ wasleep' = [wasleep EXCEPT ![r] = asl]
          /\ wvalid' = [wvalid EXCEPT ![r] = val]
          /\ mem' = [mem EXCEPT ![r] = [t \in Tags |-> MemAfter(p, did, t, @[t])]]
          /\ wpend' = [wpend EXCEPT ![r] = NoPend]
          /\ wprof' = IF p.type = "Profile" THEN [wprof EXCEPT ![r] = ProfileStart(p.level)] ELSE wprof
          /\ wcache' = [wcache EXCEPT ![r] = @ \cup {reply}]
          /\ replied' = [replied EXCEPT ![r] = @ \cup {reply}]
          /\ net' = net \cup {reply}
          /\ faults' = IF did # p.plan THEN faults + 1 ELSE faults
          /\ broken' = broken \cup (IF /\ p.type = "Profile"
                                       /\ \/ <<st, asl, val>> # <<wstate[r], wasleep[r], wvalid[r]>>
                                          \/ mem'[r] # mem[r]
                                    THEN {"P15"} ELSE {})
    /\ UNCHANGED <<alive, wepoch, applied, stageVars, nextTask>>

(* The effect raised: EffectRaised. A lifecycle effect leaves the rank FAILED. *)
EffectError(r) ==
    /\ alive[r] /\ Busy(r) /\ FaultOk("error")
    /\ LET p == wpend[r]
           st == IF p.type \in {"Execute", "Profile"} THEN wstate[r] ELSE WNext(wstate[r], "fail")
           reply == NackMsg(p.type, p.task, wepoch[r], r,
                            CASE p.type = "Execute" -> "EXECUTE_ERROR"
                              [] p.type = "Profile" -> "PROFILE_ERROR"   \* no profile runs after it
                              [] OTHER -> "BACKEND_ERROR", st)
       IN /\ wstate' = [wstate EXCEPT ![r] = st]
          /\ wpend' = [wpend EXCEPT ![r] = NoPend]
          /\ wprof' = IF p.type = "Profile" THEN [wprof EXCEPT ![r] = FALSE] ELSE wprof
          /\ wcache' = [wcache EXCEPT ![r] = @ \cup {reply}]
          /\ replied' = [replied EXCEPT ![r] = @ \cup {reply}]
          /\ net' = net \cup {reply}
    /\ faults' = faults + 1
    /\ UNCHANGED <<mem, alive, wasleep, wvalid, wepoch, applied, stageVars, nextTask, broken>>

(* The shell loaded the runner: Hello carries the rank, its epoch and its state. *)
Loaded(r) ==
    /\ alive[r] /\ WorkerLegal(wstate[r], "loaded")
    /\ wstate' = [wstate EXCEPT ![r] = WorkerNext(@, "loaded")]
    /\ net' = net \cup {HelloMsg(wepoch[r], r, wstate'[r])}
    /\ UNCHANGED <<mem, alive, wasleep, wvalid, wepoch, wpend, wprof, wcache, replied, applied, stageVars,
                   nextTask, faults, broken>>

(* The backend or the runner raised while loading (LoadFailed): the rank is
   FAILED and says so in its Hello; it answers every later command NACK FAILED. *)
LoadFailed(r) ==
    /\ alive[r] /\ WorkerLegal(wstate[r], "fail") /\ wstate[r] = WorkerInitial /\ FaultOk("error")
    /\ wstate' = [wstate EXCEPT ![r] = WorkerNext(@, "fail")]
    /\ net' = net \cup {HelloMsg(wepoch[r], r, wstate'[r])}
    /\ faults' = faults + 1
    /\ UNCHANGED <<mem, alive, wasleep, wvalid, wepoch, wpend, wprof, wcache, replied, applied, stageVars,
                   nextTask, broken>>

Crash(r) ==
    /\ alive[r] /\ FaultOk("crash")
    /\ alive' = [alive EXCEPT ![r] = FALSE]
    /\ wpend' = [wpend EXCEPT ![r] = NoPend]
    /\ faults' = faults + 1
    /\ UNCHANGED <<mem, wstate, wasleep, wvalid, wepoch, wprof, wcache, replied, applied, stageVars, nextTask,
                   net, broken>>

-----------------------------------------------------------------------------
(* ============================= orchestrator ============================== *)

Idle == stask = 0 /\ sstate \notin {"STARTING", "FAILED", "STOPPED"}   \* _require_idle
SendAll(type, t, lvl, tg) == {CmdMsg(type, t, sepoch, r, lvl, tg) : r \in Ranks}
Pending(t) == [outcome EXCEPT ![t] = "pending"]

(* What every rank must ACK, and the commit trigger, for the lifecycle task in flight. *)
Expect ==
    LET c == scmd
        toSleep == c.tags \ sasleep
        asl == CASE c.type = "Sleep" -> sasleep \cup c.tags
                 [] c.type = "Wake" -> sasleep \ c.tags
                 [] OTHER -> sasleep
        val == CASE c.type = "Sleep" -> svalid /\ ~(c.level = 2 /\ Weights \in toSleep
                                                     /\ Bug # "forget_invalidation")
                 [] c.type = "ReloadWeights" -> TRUE
                 [] OTHER -> svalid
        set == Settle(asl, val)
    IN [asleep |-> asl, valid |-> val,
        wstate |-> IF c.type = "Sleep" THEN "SLEEPING" ELSE RankState[set],
        trigger |-> IF c.type = "Sleep" THEN "slept" ELSE WakeCommit[set]]

(* The stage's own ALREADY answer (no round trip) must be true of memory, not only of its
   bookkeeping: a Sleep answered ALREADY leaves no tag of the call mapped on a live rank, a Wake
   answered ALREADY none unmapped (the `mem` ghost: "host" and "lost" are unmapped). *)
AlreadyUntrue(type, tg) ==
    \E r \in Ranks, x \in tg :
        alive[r] /\ (mem[r][x] \in {"host", "lost"}) = (type = "Wake")

IssueSleep(lvl, tg) ==
    /\ Idle /\ nextTask \in TaskIds
    /\ LET t == nextTask IN
       \/ /\ tg \subseteq sasleep /\ SLegal(sstate, "sleep_already")      \* ALREADY (P-4)
          /\ sstate' = SNext(sstate, "sleep_already")
          /\ outcome' = [outcome EXCEPT ![t] = "ok"]
          /\ broken' = broken \cup (IF AlreadyUntrue("Sleep", tg) THEN {"P4"} ELSE {})
          /\ UNCHANGED <<stask, scmd, sacks, net>>
       \/ /\ ~(tg \subseteq sasleep) /\ SLegal(sstate, "drain")           \* admission closed
          /\ LET drained == sreqs = {} \/ Bug = "no_drain" IN
             /\ sstate' = IF drained THEN SNext(SNext(sstate, "drain"), "drained")
                          ELSE SNext(sstate, "drain")
             /\ net' = IF drained THEN net \cup SendAll("Sleep", t, lvl, tg) ELSE net
             /\ sacks' = IF drained THEN {} ELSE sacks    \* reset when the Sleep goes out
          /\ stask' = t /\ scmd' = [type |-> "Sleep", level |-> lvl, tags |-> tg]
          /\ outcome' = Pending(t)
          /\ UNCHANGED broken
       \/ /\ ~(tg \subseteq sasleep) /\ ~SLegal(sstate, "drain") /\ SLegal(sstate, "sleep")
          /\ sstate' = SNext(sstate, "sleep")
          /\ net' = net \cup SendAll("Sleep", t, lvl, tg)
          /\ stask' = t /\ scmd' = [type |-> "Sleep", level |-> lvl, tags |-> tg] /\ sacks' = {}
          /\ outcome' = Pending(t)
          /\ UNCHANGED broken
    /\ nextTask' = nextTask + 1
    /\ UNCHANGED <<sepoch, sloadFailed, sasleep, svalid, sreqs, sreqReplies, sreqErr, failedRanks,
                   workerVars, faults, sprof>>

IssueWake(tg) ==
    /\ Idle /\ nextTask \in TaskIds
    /\ LET t == nextTask IN
       \/ /\ tg \cap sasleep = {} \/ Bug = "already_untrue"
          /\ SLegal(sstate, "wake_already")                               \* ALREADY (P-4)
          /\ sstate' = SNext(sstate, "wake_already")
          /\ outcome' = [outcome EXCEPT ![t] = "ok"]
          /\ broken' = broken \cup (IF AlreadyUntrue("Wake", tg) THEN {"P4"} ELSE {})
          /\ UNCHANGED <<stask, scmd, sacks, net>>
       \/ /\ tg \cap sasleep # {} /\ SLegal(sstate, "wake")
          /\ sstate' = SNext(sstate, "wake")
          /\ \E wait \in WakeWaits :      \* Engine.swap's wake waits for memory (P-16)
             /\ net' = net \cup SendAll("Wake", t, wait, tg)
             /\ scmd' = [type |-> "Wake", level |-> IF wait = 1 THEN WaitLevel(sstate) ELSE 0 - WaitLevel(sstate), tags |-> tg]
          /\ stask' = t /\ sacks' = {}
          /\ outcome' = Pending(t)
          /\ UNCHANGED broken
    /\ nextTask' = nextTask + 1
    /\ UNCHANGED <<sepoch, sloadFailed, sasleep, svalid, sreqs, sreqReplies, sreqErr, failedRanks,
                   workerVars, faults, sprof>>

(* "badsource" in Faults: the caller may name a source the runner cannot use (level 1 marks
   it on the command, so every rank judges the same source the same way, as a runner does). *)
SourceKinds == IF "badsource" \in Faults THEN {0, 1} ELSE {0}
IssueReload ==
    /\ Idle /\ nextTask \in TaskIds /\ SLegal(sstate, "reload")
    /\ \E bad \in SourceKinds : LET t == nextTask IN
       /\ sstate' = SNext(sstate, "reload")
       /\ net' = net \cup SendAll("ReloadWeights", t, bad, {})
       /\ stask' = t /\ scmd' = [type |-> "ReloadWeights", level |-> bad, tags |-> {}] /\ sacks' = {}
       /\ outcome' = Pending(t)
    /\ nextTask' = nextTask + 1
    /\ UNCHANGED <<sepoch, sloadFailed, sasleep, svalid, sreqs, sreqReplies, sreqErr, failedRanks,
                   workerVars, faults, broken, sprof>>

(* Request t goes to every rank (StageCore._dispatch): only where the stage allows
   "execute" (RUNNING, P-7). The caller says where t comes from (nextTask, or the queue). *)
Dispatch(t) ==
    /\ SLegal(sstate, "execute")
    /\ sreqs' = sreqs \cup {t}
    /\ net' = net \cup SendAll("Execute", t, 0, {})
    /\ outcome' = Pending(t)
    /\ UNCHANGED <<sstate, sepoch, stask, scmd, sacks, sloadFailed, sasleep, svalid, sreqReplies,
                   sreqErr, failedRanks, workerVars, faults, broken, sprof>>

(* A request while fewer than MaxRequests are in flight; without the admission queue
   (OmniAdmission.tla models it) a request that could not run now is simply not made. *)
IssueExecute ==
    /\ Requests /\ Cardinality(sreqs) < MaxRequests /\ nextTask \in TaskIds
    /\ Dispatch(nextTask)
    /\ nextTask' = nextTask + 1

(* StageCore.profile: a task in a settled state that the answers never move (P-15). It
   keeps its own record of who answered (sprof), so the settled state's complete ACK set
   (sacks, P-5) stands while it is in flight; requests keep being admitted meanwhile. *)
IssueProfile(start) ==
    /\ Profiles /\ Idle /\ nextTask \in TaskIds /\ SLegal(sstate, "profile")
    /\ LET t == nextTask IN
       /\ sstate' = SNext(sstate, "profile")
       /\ net' = net \cup SendAll("Profile", t, IF start THEN 1 ELSE 0, {})
       /\ stask' = t /\ scmd' = [type |-> "Profile", level |-> IF start THEN 1 ELSE 0, tags |-> {}]
       /\ sprof' = NoProf
       /\ outcome' = Pending(t)
    /\ nextTask' = nextTask + 1
    /\ UNCHANGED <<sepoch, sacks, sloadFailed, sasleep, svalid, sreqs, sreqReplies, sreqErr, failedRanks,
                   workerVars, faults, broken>>

(* The stage goes FAILED naming `ranks`; the task and the requests in flight end failed. *)
FailStage(ranks, netNext) ==
    /\ SLegal(sstate, "fail")
    /\ sstate' = SNext(sstate, "fail")
    /\ failedRanks' = ranks
    /\ outcome' = [t \in TaskIds |-> IF t \in sreqs \cup {stask} THEN "failed" ELSE outcome[t]]
    /\ stask' = 0 /\ scmd' = NoCmd /\ sacks' = {} /\ sloadFailed' = {}
    /\ sreqs' = {} /\ sreqReplies' = NoReplies /\ sreqErr' = NoErrors
    /\ sprof' = NoProf
    /\ net' = netNext
    /\ UNCHANGED <<sepoch, sasleep, svalid>>

Commit(acks, netNext) ==
    /\ sstate' = SNext(sstate, Expect.trigger)
    /\ sasleep' = Expect.asleep /\ svalid' = Expect.valid
    /\ sacks' = acks
    /\ outcome' = [outcome EXCEPT ![stask] = "ok"]
    /\ stask' = 0 /\ scmd' = NoCmd
    /\ net' = netNext
    /\ UNCHANGED <<sepoch, sloadFailed, sreqs, sreqReplies, sreqErr, failedRanks, sprof>>

(* Every rank refused the wake (waiting or not) for lack of memory: nothing stayed mapped, back to the
   state the wake came from (StageCore._maybe_commit, refused_trigger). *)
WakeRefused(said, netNext) ==
    /\ sstate' = SNext(sstate, RefusedWake(FromLevel(scmd.level)))
    /\ sacks' = said
    /\ outcome' = [outcome EXCEPT ![stask] = "refused"]
    /\ stask' = 0 /\ scmd' = NoCmd /\ sprof' = NoProf
    /\ net' = netNext
    /\ UNCHANGED <<sepoch, sloadFailed, sasleep, svalid, sreqs, sreqReplies, sreqErr, failedRanks>>

(* Every rank refused the reload's source: nothing was written, back to NEEDS_RELOAD. *)
ReloadRefused(said, netNext) ==
    /\ sstate' = SNext(sstate, "reload_refused")
    /\ sacks' = said
    /\ outcome' = [outcome EXCEPT ![stask] = "refused"]
    /\ stask' = 0 /\ scmd' = NoCmd
    /\ net' = netNext
    /\ UNCHANGED <<sepoch, sloadFailed, sasleep, svalid, sreqs, sreqReplies, sreqErr, failedRanks, sprof>>

(* Every rank answered request t; a sleep waiting on the drain goes out once none is left
   in flight (with drain_one_request: as soon as any request ends); so does an update
   (P-17, trace/OmniWeights.tla: the only other task that drains to send). A pause's drain
   ends in OmniPause.tla (nothing goes out). *)
EndRequest(t, err, netNext) ==
    /\ outcome' = [outcome EXCEPT ![t] = IF err THEN "failed" ELSE "ok"]
    /\ sreqs' = sreqs \ {t}
    /\ sreqReplies' = [sreqReplies EXCEPT ![t] = {}] /\ sreqErr' = [sreqErr EXCEPT ![t] = FALSE]
    /\ IF sstate = "DRAINING" /\ stask # 0 /\ scmd.type # "Pause" /\ (sreqs' = {} \/ Bug = "drain_one_request")
       THEN /\ sstate' = SNext(sstate, IF scmd.type = "UpdateWeights" THEN "update_drained" ELSE "drained")
            /\ net' = netNext \cup SendAll(scmd.type, stask, scmd.level, scmd.tags)
            /\ sacks' = {}
       ELSE /\ net' = netNext /\ UNCHANGED <<sstate, sacks>>
    /\ UNCHANGED <<sepoch, stask, scmd, sloadFailed, sasleep, svalid, failedRanks, sprof>>

Ignore(netNext) == net' = netNext /\ UNCHANGED stageVars

ProfileTask == stask # 0 /\ scmd.type = "Profile"
WaitingWakeTask == stask # 0 /\ scmd.type = "Wake" /\ scmd.level > 0
ForTask(m) == stask # 0 /\ m.task = stask /\ m.kind \in {"ack", "nack"}
              /\ (sstate \in {"TRANSITIONING", "WAKING"} \/ (ProfileTask /\ sstate \in Settled))
ForRequest(m) == m.task \in sreqs /\ m.kind \in {"result", "nack"}
Unknown(m) == IF m.kind = "hello" THEN sstate # "STARTING" ELSE ~(ForTask(m) \/ ForRequest(m))
Second(m) == \/ (ForTask(m) /\ ~ProfileTask /\ m.rank \in sacks)
             \/ (ForTask(m) /\ ProfileTask /\ m.rank \in sprof.said)
             \/ ForRequest(m) /\ m.rank \in sreqReplies[m.task]

OnReply(m, rest) ==
    IF (m.epoch # sepoch /\ Bug # "no_epoch_fence") \/ Unknown(m) THEN Ignore(rest)   \* P-6
    ELSE IF m.kind = "hello" THEN       \* StageCore.on_hello
        LET said == sacks \cup {m.rank}
            bad == IF m.state = "ACTIVE" THEN sloadFailed \ {m.rank} ELSE sloadFailed \cup {m.rank}
        IN IF said = Ranks /\ bad # {}
           THEN FailStage(bad, rest)     \* every rank said Hello, some FAILED: named (P-9)
           ELSE IF said = Ranks
           THEN /\ sstate' = SNext(sstate, "started") /\ sacks' = said /\ net' = rest
                /\ UNCHANGED <<sepoch, stask, scmd, sloadFailed, sasleep, svalid, sreqs,
                               sreqReplies, sreqErr, failedRanks, outcome, sprof>>
           ELSE /\ sacks' = said /\ sloadFailed' = bad /\ net' = rest
                /\ UNCHANGED <<sstate, sepoch, stask, scmd, sasleep, svalid, sreqs, sreqReplies,
                               sreqErr, failedRanks, outcome, sprof>>
    ELSE IF ForTask(m) /\ ProfileTask THEN       \* StageCore._on_profile_reply
        IF m.rank \in sprof.said THEN Ignore(rest)                     \* duplicate
        ELSE IF m.state # RankOfStage(sstate) \/ (m.kind = "ack" /\ m.asleep # sasleep)
        THEN FailStage({m.rank}, rest)          \* the rank is not where the stage committed it
        ELSE LET said == sprof.said \cup {m.rank}
                 nacks == IF m.kind = "nack" THEN sprof.nacks \cup {m.rank} ELSE sprof.nacks
             IN IF said = Ranks
                THEN /\ sstate' = SNext(sstate, "profile")         \* internal: the state stays
                     /\ outcome' = [outcome EXCEPT ![stask] = IF nacks = {} THEN "ok" ELSE "refused"]
                     /\ stask' = 0 /\ scmd' = NoCmd /\ sprof' = NoProf /\ net' = rest
                     /\ UNCHANGED <<sepoch, sacks, sloadFailed, sasleep, svalid, sreqs, sreqReplies,
                                    sreqErr, failedRanks>>
                ELSE /\ sprof' = [said |-> said, nacks |-> nacks] /\ net' = rest
                     /\ UNCHANGED <<sstate, sepoch, stask, scmd, sacks, sloadFailed, sasleep, svalid,
                                    sreqs, sreqReplies, sreqErr, failedRanks, outcome>>
    ELSE IF ForTask(m) THEN
        IF m.rank \in sacks \cup sprof.nacks THEN Ignore(rest)         \* duplicate
        ELSE IF m.kind = "nack" /\ m.info = "NO_MEMORY" /\ scmd.type = "Wake" THEN   \* any wake (P-16)
            \* a waiting wake's refusals, kept in sprof (no Profile runs meanwhile): every rank
            \* refused -> back; some woke and some refused -> FAILED naming the refusing ranks
            LET refused == sprof.nacks \cup {m.rank} IN
            IF sacks \cup refused # Ranks
            THEN /\ sprof' = [said |-> sprof.said \cup {m.rank}, nacks |-> refused] /\ net' = rest
                 /\ UNCHANGED <<sstate, sepoch, stask, scmd, sacks, sloadFailed, sasleep, svalid, sreqs,
                                sreqReplies, sreqErr, failedRanks, outcome>>
            ELSE IF sacks = {} THEN WakeRefused(refused, rest)
            ELSE FailStage(refused, rest)
        ELSE IF m.kind = "nack" /\ m.info = "INVALID_ARGUMENT" /\ scmd.type = "ReloadWeights" THEN
            LET said == sacks \cup {m.rank} IN      \* StageCore._maybe_commit: all refused?
            IF said = Ranks THEN ReloadRefused(said, rest)
            ELSE /\ sacks' = said /\ net' = rest
                 /\ UNCHANGED <<sstate, sepoch, stask, scmd, sloadFailed, sasleep, svalid, sreqs,
                                sreqReplies, sreqErr, failedRanks, outcome, sprof>>
        ELSE IF \/ m.kind = "nack"
                \/ (m.state # Expect.wstate \/ m.asleep # Expect.asleep) /\ Bug # "no_ack_check"
        THEN FailStage({m.rank}, rest)
        ELSE LET acks == sacks \cup {m.rank} IN
             IF acks \cup sprof.nacks = Ranks \/ Bug = "commit_before_all_acks"
             THEN IF sprof.nacks = {} \/ Bug = "commit_beside_no_memory" THEN Commit(acks, rest)
                  ELSE FailStage(sprof.nacks, rest)
             ELSE /\ sacks' = acks /\ net' = rest
                  /\ UNCHANGED <<sstate, sepoch, stask, scmd, sloadFailed, sasleep, svalid, sreqs,
                                 sreqReplies, sreqErr, failedRanks, outcome, sprof>>
    ELSE \* ForRequest(m)
        LET t == m.task IN
        IF m.rank \in sreqReplies[t] THEN Ignore(rest)
        ELSE LET got == sreqReplies[t] \cup {m.rank}
                 err == sreqErr[t] \/ m.kind = "nack"
             IN IF got = Ranks \/ (Bug = "early_request_finish" /\ m.kind = "nack")
                THEN EndRequest(t, err, rest)
                ELSE /\ sreqReplies' = [sreqReplies EXCEPT ![t] = got]
                     /\ sreqErr' = [sreqErr EXCEPT ![t] = err] /\ net' = rest
                     /\ UNCHANGED <<sstate, sepoch, stask, scmd, sacks, sloadFailed, sasleep, svalid,
                                    sreqs, failedRanks, outcome, sprof>>

StageReceive(m, keep) ==
    /\ m.kind \in ReplyKinds \cup {"hello"}
    /\ keep => FaultOk("dup")
    /\ OnReply(m, IF keep THEN net ELSE net \ {m})
    /\ faults' = IF keep THEN faults + 1 ELSE faults
    /\ broken' = broken \cup (IF (m.epoch # sepoch \/ Unknown(m) \/ Second(m)) /\ stageVars' # stageVars
                              THEN {"P6"} ELSE {})
                         \cup (IF /\ ForTask(m) /\ ProfileTask
                                  /\ \/ sstate' \notin {sstate, "FAILED"}
                                     \/ <<sasleep', svalid'>> # <<sasleep, svalid>>
                              THEN {"P15"} ELSE {})
    /\ UNCHANGED <<workerVars, nextTask>>

(* A reply from r for task t can no longer come: what a well-tuned deadline detects.
   With "timeout" in Faults a deadline may also pass while the reply is on its way. *)
Lost(r, t) ==
    \/ ~alive[r]
    \/ wpend[r].task # t /\ ~\E m \in net : m.task = t /\ m.rank = r /\ m.epoch = sepoch
HelloLost(r) ==
    \/ ~alive[r]
    \/ wstate[r] # "LOADING" /\ ~\E m \in net : m.kind = "hello" /\ m.rank = r /\ m.epoch = sepoch
Expired(silent, lost(_)) == silent # {} /\ ("timeout" \in Faults \/ \E r \in silent : lost(r))

(* StageCore.on_tick, and the engine's deadline on a request (P-9) *)
Deadline ==
    /\ Bug # "no_deadline"
    /\ \/ /\ sstate = "STARTING"
          /\ Expired(Ranks \ sacks, HelloLost)
          /\ FailStage(Ranks \ sacks, net)
       \/ /\ sstate \in {"TRANSITIONING", "WAKING"}
          /\ LET lost(r) == Lost(r, stask) IN Expired(Ranks \ sacks, lost)
          /\ FailStage(Ranks \ sacks, net)
       \/ /\ ProfileTask /\ sstate \in Settled
          /\ LET lost(r) == Lost(r, stask) IN Expired(Ranks \ sprof.said, lost)
          /\ FailStage(Ranks \ sprof.said, net)
       \/ /\ sstate = "DRAINING"
          /\ \E t \in sreqs : LET lost(r) == Lost(r, t) IN Expired(Ranks \ sreqReplies[t], lost)
          /\ sstate' = SNext(sstate, "drain_timeout")   \* sleep abandoned, nothing was sent
          /\ outcome' = [outcome EXCEPT ![stask] = "failed"]
          /\ stask' = 0 /\ scmd' = NoCmd
          /\ UNCHANGED <<sepoch, sacks, sloadFailed, sasleep, svalid, sreqs, sreqReplies, sreqErr,
                         failedRanks, net, sprof>>
       \/ \E t \in sreqs :
          /\ LET lost(r) == Lost(r, t) IN Expired(Ranks \ sreqReplies[t], lost)
          /\ IF Bug = "early_request_finish"
             THEN EndRequest(t, TRUE, net)     \* the request fails, the stage stays
             ELSE FailStage(Ranks \ sreqReplies[t], net)   \* a rank is silent on Execute
    /\ UNCHANGED <<workerVars, nextTask, faults, broken>>

(* The orchestrator sees a rank process die (StageCore.on_rank_died). *)
RankDied(r) ==
    /\ ~alive[r] /\ sstate \notin {"FAILED", "STOPPED"}
    /\ FailStage({r}, net)
    /\ UNCHANGED <<workerVars, nextTask, faults, broken>>

(* StageCore.restart: fresh rank processes under a new epoch, from every state the stage
   table allows (SLegal: RUNNING, SLEEPING, PARTIAL, NEEDS_RELOAD, FAILED, STOPPED; not while
   a start or a task is under way). The live ranks are killed (FreshWorkers replaces them
   with their effects unfinished), so a lifecycle task and the requests in flight end failed
   (Stage._fail_requests); the old messages stay in the network, fenced by the epoch.
   "kill" in Faults lets a model restart a stage that still serves (live ranks killed);
   without it a model restarts only after a failure, which keeps the models that do not
   look at this path (crash) small. The states themselves come from the table. *)
RestartWith(rejected) ==     \* rejected: queued requests that never ran (OmniAdmission)
    /\ SLegal(sstate, "restart") /\ sepoch < MaxEpoch
    /\ ~ProfileTask            \* StageCore.restart refuses while a Profile task is in flight
    /\ sstate # "FAILED" => "kill" \in Faults
    /\ sstate' = SNext(sstate, "restart")
    /\ sepoch' = sepoch + 1
    /\ sasleep' = {} /\ svalid' = TRUE /\ sacks' = {} /\ sloadFailed' = {} /\ failedRanks' = {}
    /\ FreshWorkers(sepoch + 1)
    /\ outcome' = [t \in TaskIds |-> IF t \in sreqs \cup {stask} THEN "failed"
                                     ELSE IF t \in rejected THEN "refused" ELSE outcome[t]]
    /\ stask' = 0 /\ scmd' = NoCmd
    /\ sreqs' = {} /\ sreqReplies' = NoReplies /\ sreqErr' = NoErrors /\ sprof' = NoProf
    /\ UNCHANGED <<applied, nextTask, net, faults, broken>>
Restart == RestartWith({})

-----------------------------------------------------------------------------
(* ================================ network =============================== *)

Drop(m) ==
    /\ FaultOk("drop")
    /\ net' = net \ {m} /\ faults' = faults + 1
    /\ UNCHANGED <<workerVars, stageVars, nextTask, broken>>

Corrupt(m) ==
    /\ m.kind = "cmd" /\ FaultOk("corrupt")
    /\ net' = (net \ {m}) \cup {BadBytes(m.rank)} /\ faults' = faults + 1
    /\ UNCHANGED <<workerVars, stageVars, nextTask, broken>>

Deliver(keep) ==
    \E m \in net : \/ \E r \in Ranks : WorkerReceive(r, m, keep)
                   \/ StageReceive(m, keep)

(* The steps of the StageCore (each an input to it), apart from those of the ranks and the
   network, so that OmniAdmission can run its queue after a stage step and before the next,
   as StageCore._pump does within the step. Restart is apart: the queue's requests end there. *)
StageCall ==
    \/ \E lvl \in SleepLevels, tg \in SleepTags : IssueSleep(lvl, TagSet(tg))
    \/ \E tg \in WakeTags : IssueWake(TagSet(tg))
    \/ IssueReload
    \/ IssueExecute
    \/ \E start \in BOOLEAN : IssueProfile(start)
    \/ \E m \in net : StageReceive(m, FALSE) \/ StageReceive(m, TRUE)   \* TRUE: a duplicate stays
    \/ \E r \in Ranks : RankDied(r)
    \/ Deadline
ProcessStep ==
    \/ \E m \in net, r \in Ranks : WorkerReceive(r, m, FALSE) \/ WorkerReceive(r, m, TRUE)
    \/ \E m \in net : Drop(m) \/ Corrupt(m)
    \/ \E r \in Ranks : Loaded(r) \/ LoadFailed(r) \/ Done(r) \/ Refused(r) \/ EffectError(r) \/ Crash(r)

Next == StageCall \/ Restart \/ ProcessStep

(* Progress: messages are delivered, effects finish, ranks load, deadlines pass, deaths are
   seen. One weak-fairness condition on all of them is enough: every such step is finite in
   number (messages and duplicates are bounded by MaxTask and MaxFaults, epochs by MaxEpoch),
   so a behaviour in which one stays enabled forever would take infinitely many. One
   condition instead of one per action keeps TLC's liveness checking cheap. *)
Progress ==
    \/ Deliver(FALSE)
    \/ \E r \in Ranks : Loaded(r) \/ Done(r) \/ Refused(r) \/ RankDied(r)
    \/ Deadline

Fairness == WF_vars(Progress)

Spec == Init /\ [][Next]_vars
FairSpec == Spec /\ Fairness

RankSymmetry == Permutations(Ranks)   \* safety configs only: symmetry is unsound for liveness

-----------------------------------------------------------------------------
(* ============================== invariants ============================== *)

TypeOK ==
    /\ wstate \in [Ranks -> WorkerStates] /\ sstate \in StageStates
    /\ alive \in [Ranks -> BOOLEAN] /\ wvalid \in [Ranks -> BOOLEAN]
    /\ wasleep \in [Ranks -> SUBSET Tags] /\ sasleep \subseteq Tags
    /\ wepoch \in [Ranks -> Epochs] /\ sepoch \in Epochs
    /\ stask \in TaskIds \cup {0}
    /\ sreqs \subseteq TaskIds /\ Cardinality(sreqs) <= MaxRequests
    /\ sreqReplies \in [TaskIds -> SUBSET Ranks] /\ sreqErr \in [TaskIds -> BOOLEAN]
    /\ \A t \in TaskIds \ sreqs : sreqReplies[t] = {} /\ ~sreqErr[t]
    /\ sacks \subseteq Ranks /\ sloadFailed \subseteq Ranks /\ failedRanks \subseteq Ranks
    /\ outcome \in [TaskIds -> {"none", "pending", "ok", "failed", "refused"}]
    /\ wprof \in [Ranks -> BOOLEAN] /\ sprof.nacks \subseteq sprof.said /\ sprof.said \subseteq Ranks
    /\ faults \in 0..MaxFaults

Executing(r) == alive[r] /\ wpend[r].type = "Execute"
Live(r) == alive[r]

(* P-1: exactly one terminal reply per (task, rank). A duplicate is answered again, so the
   same reply may go out twice (the cached one), and a refusal may be repeated (it carries
   the state of the moment); what must never happen is two verdicts for one task: refused
   and then done, or done twice with different results. *)
Refusals == {"STALE_EPOCH", "INVALID_STATE", "BUSY", "FAILED", "UNKNOWN_TAG", "UNSUPPORTED",
             "TASK_ID_REUSED"}
Verdict(m) == IF m.kind = "nack" /\ m.info \in Refusals THEN [m EXCEPT !.info = "refused", !.state = NoVal]
              ELSE m
P1_OneTerminalReplyPerTask ==
    \A r \in Ranks : \A a, b \in replied[r] : a.task = b.task => Verdict(a) = Verdict(b)

(* P-2: a duplicate command is answered from the reply cache with no second effect. *)
P2_NoTaskAppliedTwice == \A r \in Ranks : \A t \in TaskIds : applied[r][t] <= 1

(* P-3: every message carries version, task_id, epoch; replies carry the rank. *)
P3_MessagesCarryIds ==
    \A m \in net : m.kind # "bad" =>
        /\ m.v = Version /\ m.task \in TaskIds \cup {0} /\ m.epoch \in Epochs
        /\ (m.kind \in ReplyKinds \cup {"hello"} => m.rank \in Ranks)

(* P-4: Sleep of asleep tags / Wake of resident tags is an ALREADY no-op; the stage answers
   ALREADY itself only where that is true of every live rank's memory (AlreadyUntrue). *)
P4_AlreadyIsNoOp == "P4" \notin broken

(* P-5: the stage commits a settled state only on a complete set of agreeing ACKs. *)
P5_CommitOnlyOnAllAcks == sstate \in Settled => sacks = Ranks
P5_SleepingOnlyIfEveryRankAsleep ==
    sstate = "SLEEPING" => \A r \in Ranks : Live(r) => wstate[r] = "SLEEPING" /\ wasleep[r] = sasleep
P5_RanksAgreeWithStage ==
    sstate \in Settled =>
        \A r \in Ranks : Live(r) => /\ StageOfRank(wstate[r]) = sstate
                                    /\ wasleep[r] = sasleep /\ wvalid[r] = svalid

(* P-6: a stale-epoch or unknown reply never changes the stage; a stale command gets
   NACK STALE_EPOCH and never changes the worker. *)
P6_StaleNeverChangesState == "P6" \notin broken

(* P-7: nothing executes unless every tag is resident on every rank. *)
P7_ExecuteOnlyWhenResident ==
    \A r \in Ranks : Executing(r) =>
        /\ wstate[r] = "ACTIVE"
        /\ \A q \in Ranks : Live(q) => wasleep[q] = {} /\ wstate[q] # "OFFLOADING"

(* P-8: after a level-2 sleep nothing executes until the weights are reloaded. *)
P8_NoExecuteAfterL2BeforeReload ==
    \A r \in Ranks : Executing(r) => \A q \in Ranks : Live(q) => wvalid[q] /\ wstate[q] # "RELOADING"

(* P-7 and P-8 over what memory holds (the ghost mem), not over the cores' bookkeeping: a
   Residency that lies (bug model forget_invalidation) or a stage that trusts a disagreeing
   ACK (no_ack_check) keeps P7/P8 above true while a request runs on memory that is gone. *)
MemoryEffect(q) == wpend[q].type \in {"Sleep", "Wake", "ReloadWeights"}
P7_Mem_ExecuteOnMappedMemory ==
    \A r \in Ranks : Executing(r) =>
        \A q \in Ranks : Live(q) => (\A t \in Tags : mem[q][t] \in {"valid", "garbage"}) /\ ~MemoryEffect(q)
P8_Mem_NoExecuteOnGarbageWeights ==
    \A r \in Ranks : Executing(r) => \A q \in Ranks : Live(q) => \A t \in Tags \cap {Weights} : mem[q][t] = "valid"
(* The cores' view is an abstraction of memory: a live rank that has not failed holds asleep
   exactly the unmapped tags, and calls its weights valid exactly when their values are on the
   device or on the host (so a wake of an offloaded tag restores valid content). *)
Mem_CoresAgreeWithMemory ==
    \A r \in Ranks : Live(r) /\ wstate[r] # "FAILED" =>
        /\ wasleep[r] = {t \in Tags : mem[r][t] \in {"host", "lost"}}
        /\ \A t \in Tags \cap {Weights} : wvalid[r] <=> mem[r][t] \in {"valid", "host"}

(* OmniSleep refines the abstract memory spec OmniMemory: a dead rank's memory is gone, the
   ranks running a request are those with an Execute pending. Checked as a property by the
   model "memory" (no symmetry: TLC checks a property over the full state graph). *)
MemAbs == [r \in Ranks |-> IF alive[r] THEN mem[r] ELSE [t \in Tags |-> "gone"]]
Memory == INSTANCE OmniMemory WITH mem <- MemAbs, running <- {r \in Ranks : Executing(r)}
MemoryRefined == Memory!Spec

(* P-9: a FAILED stage names the ranks that failed it. *)
P9_FailedNamesRanks == sstate = "FAILED" => failedRanks # {}

(* P-10: undecodable bytes get NACK BAD_MESSAGE and the worker keeps serving. *)
P10_BadBytesKeepServing == "P10" \notin broken

(* P-11: a refused command has no effect. *)
P11_RefusalHasNoEffect == "P11" \notin broken

(* P-15: a Profile, its effect and its answers never change a rank's state or residency, nor
   the stage's (a rank found elsewhere than the stage committed it fails the stage, P-9). *)
P15_ProfileNeverChangesState == "P15" \notin broken

(* The cores' own _check_invariants, mirrored. *)
WorkerCoreInvariants ==
    \A r \in Ranks : Live(r) =>
        /\ wstate[r] \in Transient => Busy(r)
        /\ wstate[r] = "ACTIVE" => wasleep[r] = {} /\ wvalid[r]
        /\ wstate[r] \in {"SLEEPING", "PARTIAL"} => wasleep[r] # {}
        /\ wstate[r] = "NEEDS_RELOAD" => Weights \notin wasleep[r] /\ ~wvalid[r]
        /\ wpend[r].type = "Execute" => wstate[r] = "ACTIVE"
        /\ wpend[r].type = "Profile" => WLegal(wstate[r], "profile")
        /\ wprof[r] => wstate[r] \notin {"LOADING", "STOPPED"}
StageCoreInvariants ==
    /\ (stask # 0 /\ ~ProfileTask) <=> (sstate \in InTask)
    /\ ProfileTask => sstate \in Settled
    /\ ~ProfileTask /\ ~WaitingWakeTask => sprof = NoProf
    /\ WaitingWakeTask => sprof.said = sprof.nacks       \* only its NO_MEMORY refusals are kept
    /\ sreqs # {} => sstate \in {"RUNNING", "DRAINING"}
    /\ sstate = "RUNNING" => sasleep = {} /\ svalid

-----------------------------------------------------------------------------
(* =============================== liveness =============================== *)

(* Written as <>[] over the outcome record rather than as one ~> per task: equivalent here
   (a task is issued once and its outcome is final), and TLC checks it several times faster. *)

(* Without crashes or losses every issued command completes, and the stage starts. *)
EveryCommandCompletes ==
    <>[](sstate # "STARTING" /\ \A t \in TaskIds : outcome[t] \in {"none", "ok"})

(* With crashes, losses and deadlines every command ends: completed, or FAILED naming the
   ranks (P-9); start-up ends too (RUNNING or FAILED). *)
EveryCommandEnds ==
    <>[](sstate # "STARTING" /\ \A t \in TaskIds : outcome[t] # "pending")

=============================================================================
