------------------------------- MODULE OmniTrace -------------------------------
(***************************************************************************)
(* Trace validation: does a run of the real engine and its ranks replay as *)
(* a behaviour of OmniSleep?                                                *)
(*                                                                         *)
(* `Trace` (module TraceData, GENERATED per stage or chunk by               *)
(* omni_core/formal/trace_export.py from the typed records of a run,        *)
(* omni_core/fsm/trace_records.py) is the stage's events in file order.     *)
(* Each record kind is one action here: a step consumes Trace[i] by taking  *)
(* the OmniSleep action its kind names (the spec's own actions, unchanged)  *)
(* and comparing what was recorded with the spec's variables: the stage     *)
(* state and epoch on every engine record, the worker state on every worker *)
(* record, the reply's kind, state and status on every receipt.            *)
(*                                                                         *)
(* The cores write each record before any message of its action leaves:    *)
(* the engine's issue, dispatch, recv, deadline, restart and died records, *)
(* the worker's start, wrecv, done, error and refused records are actions. *)
(* Records of what a step already did (the engine's send records and the   *)
(* state record of a change made by a receipt, the worker's wstate and     *)
(* wsend records) are checks. The cores return them in a fixed order, so   *)
(* the checks are obligations: a stage change                              *)
(* must be logged by the next engine line, every command the engine put on *)
(* the network must be logged as sent before the engine does anything else *)
(* and before a rank receives it, a worker state change must be logged     *)
(* before that worker's next step, and the reply its step produced logged  *)
(* (wsend) before its next step and before the engine takes it. A worker   *)
(* line is a step of the live process of its epoch (WorkerLive); a         *)
(* deadline fires at or after its time (E.late) naming the silent ranks.   *)
(* Dropping, changing or reordering lines                                  *)
(* then leaves a step that no action matches.                               *)
(*                                                                         *)
(* P-17's weight commands (OmniWeights.tla) replay on actions of their own *)
(* beside OmniSleep's; every record also carries the weights version (v): *)
(* the version an UpdateWeights sends (its issue, and its send as the      *)
(* level), the version every reply reports (wsend: the rank's; recv of a   *)
(* result: the committed one; an update's ACK: the version sent), and the  *)
(* committed version after each change of the stage (state).              *)
(*                                                                         *)
(* A pause (PAUSED) is replayed too: its lines are the stage's own (EnginePause), and a      *)
(* paused stage is OmniSleep's RUNNING with spaused set (Shown), which admits no request;   *)
(* a paused stage's sleep and wake keep the pause until resume. Not replayed: a pause's     *)
(* drain that outlives its deadline.                                                        *)
(*                                                                         *)
(* The trace is accepted when it is consumed with no obligation left: the  *)
(* invariant TraceAccepted is then violated (TLC exit 12 naming it). Any    *)
(* other end means the trace diverged; TraceProgress prints the index each *)
(* state reached, and the highest one is where no action matched.          *)
(***************************************************************************)
EXTENDS OmniWeights, Sequences, TraceData

VARIABLES
    i,          \* the next trace event to consume
    owedState,  \* a stage change made by a step, not yet logged by a "state" line
    owedSends,  \* commands the orchestrator put on the network, not yet logged as sent
    wowed,      \* per rank: a worker state change not yet logged by its "state" line
    wreply,     \* per rank: the reply (or Hello) its last step produced, not yet logged as sent
    unsent,     \* replies a rank produced but never logged: it died first, so they never left
    wstat,      \* per rank: the Status task whose effect runs (NoStatus: none)
    spaused     \* the stage is paused (Engine.pause until Engine.resume; see Shown)

traceVars == <<i, owedState, owedSends, wowed, wreply, unsent, wstat, spaused>>

Unlogged == "?"
NoOwed == [b |-> NoVal, s |-> NoVal]
NoStatus == -100      \* task numbers are >= -1 (-1: a task the engine never named)
Change(before, after) == IF before = after THEN NoOwed ELSE [b |-> before, s |-> after]
E == Trace[i]
TagsOf(tg) == IF tg = {"all"} THEN Tags ELSE tg       \* tags=None on the wire: every tag
(* A pause lives in the orchestrator's admission alone (nothing goes to the ranks): the spec
   replays a PAUSED stage as OmniSleep's RUNNING with spaused set, admitting no request, and
   the records name that state PAUSED. A paused stage that sleeps and wakes is still paused
   (its wake commits PAUSED) until resume; its sleep from PAUSED drains nothing, as from a
   RUNNING stage with no request in flight. *)
Shown(s) == IF spaused /\ s = "RUNNING" THEN "PAUSED" ELSE s
ShownNext == IF spaused' /\ sstate' = "RUNNING" THEN "PAUSED" ELSE sstate'

(* A long trace is replayed in chunks (trace_export.split). A chunk after the first starts
   from the state the previous one ended in (Carried: TLC printed it, the checker pastes
   it into TraceData) with an empty network and empty histories; a chunk that is not the
   last must end quiescent, so that nothing dropped at the cut could still matter. *)
CarriedInit ==
    /\ wstate = Carried.wstate /\ alive = Carried.alive /\ wasleep = Carried.wasleep
    /\ wvalid = Carried.wvalid /\ wepoch = Carried.wepoch
    /\ mem = [r \in Ranks |-> MemFrom(Carried.wasleep[r], Carried.wvalid[r])]
    /\ wpend = [r \in Ranks |-> NoPend] /\ wcache = [r \in Ranks |-> {}]
    /\ wprof = Carried.wprof /\ sprof = NoProf     \* a chunk ends with no task in flight
    /\ replied = [r \in Ranks |-> {}] /\ applied = [r \in Ranks |-> [t \in TaskIds |-> 0]]
    /\ sstate = Carried.sstate /\ sepoch = Carried.sepoch /\ stask = 0 /\ scmd = NoCmd
    /\ sacks = Carried.sacks /\ sloadFailed = {} /\ sasleep = Carried.sasleep /\ svalid = Carried.svalid
    /\ sreqs = {} /\ sreqReplies = NoReplies /\ sreqErr = NoErrors /\ failedRanks = Carried.failedRanks
    /\ outcome = [t \in TaskIds |-> "none"] /\ nextTask = 1
    /\ net = {} /\ faults = 0 /\ broken = {}

TraceInit ==
    /\ \/ FromStart /\ Init
       \/ ~FromStart /\ CarriedInit
    /\ WeightsInit(FromStart, Carried)
    /\ FloorInit(FromStart, Carried)
    /\ i = 1
    /\ owedState = NoOwed
    /\ owedSends = {}
    /\ wowed = [r \in Ranks |-> NoOwed]
    /\ wreply = [r \in Ranks |-> NoMsg]
    /\ unsent = {}
    /\ wstat = [r \in Ranks |-> NoStatus]
    /\ spaused = FALSE

Advance == i' = i + 1
EngineFree == owedState = NoOwed /\ owedSends = {}
OweStage == owedState' = Change(Shown(sstate), ShownNext)
OweSends == owedSends' = {m \in net' \ net : m.kind = "cmd"}
OweWorker(r) == wowed' = [wowed EXCEPT ![r] = Change(wstate[r], wstate'[r])]
WorkerFree(r) == wowed[r] = NoOwed /\ wreply[r] = NoMsg /\ wstat[r] = NoStatus
StatusAck(r) == AckMsg("Status", E.t, wepoch[r], r, wstate[r], wasleep[r], "OK")
(* Every worker line is a step of the live process that wrote it: rank E.r of epoch E.pe.
   A line after that rank's death (or of a process a restart replaced) matches nothing. *)
WorkerLive == alive[E.r] /\ wepoch[E.r] = E.pe
(* The reply a worker step produced: logged (wsend) before that rank's next step. *)
OweReply(r, m) == wreply' = [wreply EXCEPT ![r] = m]
NewReply(r) == IF replied'[r] \ replied[r] = {} THEN NoMsg ELSE CHOOSE m \in replied'[r] \ replied[r] : TRUE
NotYetSent(m) == m \in unsent \/ \E r \in Ranks : wreply[r] = m

-----------------------------------------------------------------------------
(* ============================== engine lines ============================ *)

(* recv (StageReceived): the orchestrator takes a reply (Ack, Nack, Result) or a Hello. *)
EngineRecv ==
    /\ E.k = "recv" /\ EngineFree /\ Shown(sstate) = E.s
    /\ \E m \in net :
          /\ ~NotYetSent(m)     \* a rank logs a reply before it leaves
          /\ m.kind = E.c /\ m.task = E.t /\ m.rank = E.r /\ m.epoch = E.e
          /\ E.w # Unlogged => m.state = E.w
          /\ E.x # Unlogged => m.info = E.x
          /\ \E keep \in BOOLEAN : StageTake(m, keep, E.v)     \* keep: see Resent
    /\ E.c = "result" => E.v = sver      \* a request ran on the committed version (P-17)
    /\ OweStage /\ OweSends
    /\ UNCHANGED <<wowed, wreply, unsent, wstat>>
    /\ Advance

(* An action of the engine's own that leaves the stage in E.s; what it sends is owed. *)
EngineStep(action) ==
    /\ EngineFree /\ Shown(sstate) = E.b
    /\ action
    /\ ShownNext = E.s /\ sepoch' = E.e
    /\ OweSends
    /\ UNCHANGED owedState

(* issue (StageIssued): a lifecycle call, as the spec issues it (ALREADY included). *)
EngineIssue ==
    /\ E.k = "issue" /\ E.t = nextTask /\ wtask = 0
    /\ EngineStep(\/ /\ \/ E.c = "Sleep" /\ IssueSleep(E.lvl, TagsOf(E.tg))
                        \/ /\ E.c = "Wake" /\ IssueWake(TagsOf(E.tg))
                           /\ stask' # 0 => ((scmd'.level > 0) = (E.lvl = 1))   \* a waiting wake (P-16): level 1
                        \/ E.c = "ReloadWeights" /\ IssueReload
                        \/ E.c = "Profile" /\ IssueProfile(E.lvl = 1)   \* P-15: never changes state
                     /\ UNCHANGED weightVars
                  \/ E.c = "UpdateWeights" /\ IssueUpdate(E.v)       \* P-17: above the committed version
                  \/ E.c \in Stateless /\ IssueWeightTask(E.c))
    /\ UNCHANGED <<wowed, wreply, unsent, wstat>>
    /\ Advance

(* restart (StageRestarted): fresh ranks under a new epoch, from any state the stage table
   allows; the old processes are killed, so what they had not logged never left. *)
EngineRestart ==
    /\ E.k = "restart" /\ EngineStep(Restart) /\ WeightsRestarted(E.v)
    /\ FloorRestarted(E.x = "needs_reload", E.lvl)      \* what the restart planned: lvl is its floor
    /\ wowed' = [r \in Ranks |-> NoOwed]
    /\ wreply' = [r \in Ranks |-> NoMsg]
    /\ unsent' = unsent \cup ({wreply[r] : r \in Ranks} \ {NoMsg})
    /\ wstat' = [r \in Ranks |-> NoStatus]
    /\ Advance

(* deadline (StageDeadline): a start, a task, a drain or a request ran out of time. It is
   an obligation of the clock: the record's time (the earlier of the core's `now_s` and the
   line's stamp) is at or after the deadline it names (E.late: microseconds past it), and a
   FAILED stage names exactly the ranks that had not answered (E.fr, as FailStage does). *)
EngineDeadline ==
    /\ E.k = "deadline" /\ E.late >= 0
    /\ \/ sstate = "STARTING" /\ E.t = 0          \* the deadline names what set it: the start,
       \/ stask # 0 /\ E.t = stask                \* the task in flight,
       \/ E.t \in sreqs                           \* or a request in flight
    /\ EngineStep(Deadline)
    /\ E.s = "FAILED" => failedRanks' = E.fr
    /\ UNCHANGED <<wowed, wreply, unsent, wstat>>
    /\ Advance

(* state (StageChanged): logs the change the engine's last step made. *)
EngineState ==
    /\ E.k = "state" /\ owedState = [b |-> E.b, s |-> E.s] /\ sepoch = E.e
    /\ E.v = sver                  \* the version committed now (P-17)
    /\ owedState' = NoOwed
    /\ UNCHANGED <<vars, owedSends, wowed, wreply, unsent, wstat>>
    /\ Advance

(* dispatch (StageDispatched): a request goes to every rank at once. *)
EngineDispatch ==
    /\ E.k = "dispatch" /\ EngineFree /\ ~spaused /\ sstate = E.s /\ sepoch = E.e /\ E.t = nextTask
    /\ IssueExecute
    /\ OweSends
    /\ UNCHANGED <<owedState, wowed, wreply, unsent, wstat>>
    /\ Advance

(* A retry with the same task id re-sends the command to the ranks that have not
   answered; an identical message again is what the spec's network duplication is
   (Deliver with keep = TRUE), so a re-send is replayed as one: the copy stays on the
   network when the first one is received (and its cached reply when the engine takes the
   first), within the "dup" budget the projection counts from the re-sent records. *)
Resent(fits(_)) == "dup" \in Faults /\ \E m \in net \ owedSends : fits(m)

(* send (StageSent): logs one of the commands a step put on the network, or a re-send. *)
EngineSend ==
    /\ E.k = "send" /\ owedState = NoOwed /\ Shown(sstate) = E.s /\ sepoch = E.e
    /\ LET fits(m) == /\ m.kind = "cmd" /\ m.type = E.c /\ m.task = E.t /\ m.rank = E.r
                      /\ m.epoch = E.e
                      /\ E.lvl # 0 => m.level = E.lvl
                      /\ E.tg # {Unlogged} => m.tags = TagsOf(E.tg)
       IN \/ /\ \E m \in owedSends : fits(m) /\ owedSends' = owedSends \ {m}
             /\ UNCHANGED vars
          \/ /\ Resent(fits)
             /\ UNCHANGED <<vars, owedSends>>
    /\ UNCHANGED <<owedState, wowed, wreply, unsent, wstat>>
    /\ Advance

(* died (RankDied): the orchestrator saw rank E.r's process end (StageCore.on_rank_died);
   a stage already FAILED or STOPPED ignores it. *)
EngineDied ==
    /\ E.k = "died" /\ EngineFree /\ Shown(sstate) = E.s /\ sepoch = E.e /\ ~alive[E.r]
    /\ IF sstate \in {"FAILED", "STOPPED"} THEN UNCHANGED vars ELSE RankDied(E.r)
    /\ OweStage /\ OweSends
    /\ UNCHANGED <<wowed, wreply, unsent, wstat>>
    /\ Advance

(* The kill itself is in no line (a killed process writes nothing): the spec's Crash,
   taken right before the death is seen. *)
HiddenCrash ==
    /\ i <= Len(Trace) /\ E.k = "died" /\ alive[E.r]
    /\ Crash(E.r)
    /\ wowed' = [wowed EXCEPT ![E.r] = NoOwed]
    /\ wreply' = [wreply EXCEPT ![E.r] = NoMsg]
    /\ unsent' = unsent \cup ({wreply[E.r]} \ {NoMsg})
    /\ wstat' = [wstat EXCEPT ![E.r] = NoStatus]
    /\ UNCHANGED <<i, owedState, owedSends>>

(* ended, answered (TaskEnded, RequestAnswered): what a caller heard, tied to what the
   ranks answered. A task or request the spec's answers ended "ok" is the only one its caller
   may hear succeed; one that failed, was refused or is still running is the only one it may
   hear fail (a request aborted by a pause or sleep hears so while its ranks still run it).
   A task the engine never named (a pause, a resume: t < 1) has nothing to be tied to. *)
CallerHeard ==
    /\ E.k \in {"ended", "answered"}
    /\ E.t \in TaskIds => (E.x = "ok") = (outcome[E.t] = "ok")
    /\ UNCHANGED <<vars, owedState, owedSends, wowed, wreply, unsent, wstat>>
    /\ Advance

(* The pause's own lines (StageChanged, no task, nothing sent; StageCore._pause, _resume):
   a RUNNING stage with no request in flight pauses at once; with requests in flight its
   admission closes (DRAINING, which OmniSleep's EndRequest leaves alone for a Pause) and it
   commits PAUSED once the last one has ended; a PAUSED stage resumes. *)
PauseCmd == [type |-> "Pause", level |-> 0, tags |-> {}]
EnginePause ==
    /\ E.k = "state" /\ EngineFree /\ sepoch = E.e /\ E.v = sver
    /\ \/ /\ Shown(sstate) = "RUNNING" /\ E.b = "RUNNING" /\ Idle
          /\ \/ E.s = "PAUSED" /\ sreqs = {} /\ spaused' = TRUE /\ UNCHANGED stageVars
             \/ /\ E.s = "DRAINING" /\ sreqs # {} /\ UNCHANGED spaused
                /\ sstate' = SNext(sstate, "drain") /\ scmd' = PauseCmd
                /\ UNCHANGED <<sepoch, stask, sacks, sloadFailed, sasleep, svalid, sreqs, sreqReplies,
                               sreqErr, failedRanks, outcome, sprof>>
       \/ /\ sstate = "DRAINING" /\ scmd = PauseCmd /\ sreqs = {} /\ E.b = "DRAINING" /\ E.s = "PAUSED"
          /\ sstate' = "RUNNING" /\ scmd' = NoCmd /\ spaused' = TRUE
          /\ UNCHANGED <<sepoch, stask, sacks, sloadFailed, sasleep, svalid, sreqs, sreqReplies,
                         sreqErr, failedRanks, outcome, sprof>>
       \/ /\ Shown(sstate) = "PAUSED" /\ E.b = "PAUSED" /\ E.s = "RUNNING" /\ Idle
          /\ spaused' = FALSE /\ UNCHANGED stageVars
    /\ UNCHANGED <<workerVars, nextTask, faults, broken, net>>
    /\ UNCHANGED <<owedState, owedSends, wowed, wreply, unsent, wstat>>
    /\ Advance

-----------------------------------------------------------------------------
(* ============================== worker lines ============================ *)

(* start (WorkerStarted): the rank loaded its runner (ACTIVE), loaded it with weights not to be
   served (NEEDS_RELOAD: a restart under a version floor, dummy weights), or loading raised
   (FAILED); the Hello, carrying that state, goes out. *)
WorkerStart ==
    /\ E.k = "start" /\ WorkerFree(E.r) /\ WorkerLive
    /\ (Loaded(E.r) \/ LoadFailed(E.r) \/ LoadedNeedsReload(E.r))
    /\ wstate'[E.r] = E.w
    /\ OweReply(E.r, HelloMsg(wepoch[E.r], E.r, wstate'[E.r]))
    /\ UNCHANGED <<owedState, owedSends, wowed, unsent, wstat>>
    /\ Advance

(* wrecv (WorkerReceived): WorkerCore.step(CommandReceived), with the state before it. The engine
   records a send before the command leaves, so an unrecorded command cannot be received. *)
WorkerRecv ==
    /\ E.k = "wrecv" /\ WorkerFree(E.r) /\ WorkerLive /\ wstate[E.r] = E.w
    /\ \E m \in net \ owedSends :
          /\ m.kind = "cmd" /\ m.type = E.c /\ m.task = E.t /\ m.rank = E.r /\ m.epoch = E.e
          /\ \E keep \in BOOLEAN : RankTake(E.r, m, keep)   \* keep: see Resent
          /\ OweReply(E.r, RankAnswer(E.r, m))        \* NoMsg: the answer comes later
    /\ OweWorker(E.r)
    /\ UNCHANGED <<owedState, owedSends, unsent, wstat>>
    /\ Advance

(* done / error (EffectDone, EffectFailed): the effect finished or raised, with the
   state after it. *)
WorkerDone ==
    /\ E.k \in {"done", "error"} /\ WorkerFree(E.r) /\ WorkerLive
    /\ wpend[E.r].task = E.t /\ wpend[E.r].type = E.c
    /\ IF WeightPending(E.r) THEN IF E.k = "done" THEN WeightDone(E.r) ELSE WeightFailed(E.r)
       ELSE IF E.k = "done" THEN Done(E.r) /\ RankReloaded(E.r, E.v)
       ELSE EffectError(E.r) /\ UNCHANGED weightVars
    /\ wstate'[E.r] = E.w
    /\ OweWorker(E.r) /\ OweReply(E.r, NewReply(E.r))
    /\ UNCHANGED <<owedState, owedSends, unsent, wstat>>
    /\ Advance

(* refused (EffectRefused): the runner refused the reload's source before writing. *)
WorkerRefused ==
    /\ E.k = "refused" /\ WorkerFree(E.r) /\ WorkerLive
    /\ wpend[E.r].task = E.t /\ wpend[E.r].type = E.c
    /\ IF WeightPending(E.r) THEN WeightRefused(E.r) ELSE Refused(E.r) /\ UNCHANGED weightVars
    /\ wstate'[E.r] = E.w
    /\ OweWorker(E.r) /\ OweReply(E.r, NewReply(E.r))
    /\ UNCHANGED <<owedState, owedSends, unsent, wstat>>
    /\ Advance

(* Status (P-7: legal everywhere, changes nothing), which only a client other than the engine
   sends (the engine never does): a busy rank answers at once from what it knows; an idle one
   runs a Status effect (its done line) and answers after it, taking nothing else meanwhile
   (a command that reached it then would be answered BUSY, which is not modelled). *)
WorkerStatus ==
    /\ E.k = "wrecv" /\ E.c = "Status" /\ WorkerFree(E.r) /\ WorkerLive /\ wstate[E.r] = E.w
    /\ IF Busy(E.r) THEN OweReply(E.r, StatusAck(E.r)) /\ UNCHANGED wstat
                    ELSE wstat' = [wstat EXCEPT ![E.r] = E.t] /\ UNCHANGED wreply
    /\ UNCHANGED <<vars, owedState, owedSends, wowed, unsent>>
    /\ Advance

WorkerStatusDone ==
    /\ E.k = "done" /\ E.c = "Status" /\ WorkerLive /\ wstat[E.r] = E.t /\ wstat[E.r] # NoStatus
    /\ wowed[E.r] = NoOwed /\ wreply[E.r] = NoMsg /\ wstate[E.r] = E.w
    /\ wstat' = [wstat EXCEPT ![E.r] = NoStatus]
    /\ OweReply(E.r, StatusAck(E.r))
    /\ UNCHANGED <<vars, owedState, owedSends, wowed, unsent>>
    /\ Advance

(* wstate (WorkerChanged): logs the change the worker's last step made. *)
WorkerState ==
    /\ E.k = "wstate" /\ WorkerLive /\ wowed[E.r] = [b |-> E.b, s |-> E.w]
    /\ wowed' = [wowed EXCEPT ![E.r] = NoOwed]
    /\ UNCHANGED <<vars, owedState, owedSends, wreply, unsent, wstat>>
    /\ Advance

(* wsend (ReplySent): logs the reply (or Hello) this rank's last step produced, after its
   state line and before its next step: a reply no step of this process produced at this
   point of its history, or one logged late or never, matches nothing. *)
WorkerSend ==
    /\ E.k = "wsend" /\ WorkerLive /\ wowed[E.r] = NoOwed
    /\ LET m == wreply[E.r] IN
          /\ m # NoMsg /\ m.kind = E.c /\ m.task = E.t /\ m.epoch = E.e
          /\ E.v = wver[E.r]              \* the version the rank holds (P-17)
          /\ E.w \notin {Unlogged, ""} => m.state = E.w
          /\ E.x # Unlogged => m.info = E.x
    /\ wreply' = [wreply EXCEPT ![E.r] = NoMsg]
    /\ UNCHANGED <<vars, owedState, owedSends, wowed, unsent, wstat>>
    /\ Advance

-----------------------------------------------------------------------------

TraceNext ==
    \/ /\ i <= Len(Trace)
       /\ \/ /\ UNCHANGED <<spaused, floorVars>>
             /\ \/ EngineRecv \/ EngineIssue \/ WorkerRecv \/ WorkerDone \/ WorkerRefused
                \/ /\ \/ EngineDeadline \/ EngineState \/ EngineDispatch \/ EngineSend \/ EngineDied \/ CallerHeard
                      \/ WorkerStart \/ WorkerState \/ WorkerSend \/ WorkerStatus \/ WorkerStatusDone
                   /\ UNCHANGED weightVars
          \/ spaused' = FALSE /\ EngineRestart      \* fresh ranks, a fresh stage: no pause
          \/ EnginePause /\ UNCHANGED <<weightVars, floorVars>>
    \/ HiddenCrash /\ UNCHANGED <<weightVars, floorVars, spaused>>

TraceSpec == TraceInit /\ [][TraceNext]_<<vars, traceVars, weightVars, floorVars>>

(* Violated exactly when the whole trace has been replayed and the engine owes no line
   (and, for a chunk that is not the last, nothing is in flight):
   TLC's "Invariant TraceAccepted is violated" means ACCEPTED. *)
Quiescent ==
    /\ stask = 0 /\ sreqs = {} /\ wtask = 0
    /\ \A r \in Ranks : wpend[r] = NoPend /\ wowed[r] = NoOwed /\ wstat[r] = NoStatus
    /\ \A m \in net : m.epoch # sepoch             \* older epochs' messages can reach no one

TraceAccepted == ~(/\ i > Len(Trace) /\ owedState = NoOwed /\ owedSends = {}
                   /\ \A r \in Ranks : wreply[r] = NoMsg
                   /\ ChunkEnd => Quiescent)

(* A state constraint that prints how far each state got (and the spec's view there):
   after a run that does not violate TraceAccepted, the highest index is where the trace
   diverged. Ranks are 0..N-1. *)
RankList(f) == [k \in 1..Cardinality(Ranks) |-> f[k - 1]]
TraceProgress ==
    PrintT(<<"@trace", i, sstate, sepoch, RankList(wstate), RankList(alive), owedState.s,
             Cardinality(owedSends), RankList([r \in Ranks |-> wowed[r].s]),
             RankList([r \in Ranks |-> wreply[r].kind])>>)

=============================================================================
