------------------------------- MODULE OmniTrace -------------------------------
(***************************************************************************)
(* Trace validation: does a run of the real engine and its ranks replay as *)
(* a behaviour of OmniSleep?                                                *)
(*                                                                         *)
(* `Trace` (module TraceData, GENERATED per stage or chunk by               *)
(* omni_core/formal/trace_export.py from the JSON-lines trace) is the       *)
(* stage's projected events in file order. Each step consumes Trace[i] by   *)
(* taking the OmniSleep action it names (the spec's own actions, unchanged) *)
(* and comparing what was logged with the spec's variables: the stage state *)
(* and epoch on every engine line, the worker state on every worker line,   *)
(* the reply's kind, state and status on every receipt.                     *)
(*                                                                         *)
(* One process's line can come after the line of a step it caused in       *)
(* another (a worker writes "send:Ack" after sending, the engine may log    *)
(* the receipt first), so each action is mapped to the line its process    *)
(* writes BEFORE any message of that action leaves: the engine's "state"   *)
(* and first "send" lines, the worker's "recv:", "done:" and "start" lines, *)
(* the engine's "recv" line. Lines written after the step (the engine's     *)
(* further "send" lines and its "state" line of a change made by a receipt,*)
(* the worker's "state" and "send:" lines) are checks. The engine writes   *)
(* them in a fixed order, so the checks are obligations: a stage change    *)
(* must be logged by the next engine line, every command the engine put on *)
(* the network must be logged as sent before the engine does anything else *)
(* and before a rank receives it, a worker state change must be logged     *)
(* before that worker's next step. Dropping, changing or reordering lines  *)
(* then leaves a step that no action matches.                               *)
(*                                                                         *)
(* The trace is accepted when it is consumed with no obligation left: the  *)
(* invariant TraceAccepted is then violated (TLC exit 12 naming it). Any    *)
(* other end means the trace diverged; TraceProgress prints the index each *)
(* state reached, and the highest one is where no action matched.          *)
(***************************************************************************)
EXTENDS OmniSleep, Sequences, TraceData

VARIABLES
    i,          \* the next trace event to consume
    owedState,  \* a stage change made by a step, not yet logged by a "state" line
    owedSends,  \* commands the orchestrator put on the network, not yet logged as sent
    wowed       \* per rank: a worker state change not yet logged by its "state" line

traceVars == <<i, owedState, owedSends, wowed>>

Unlogged == "?"
NoOwed == [b |-> NoVal, s |-> NoVal]
Change(before, after) == IF before = after THEN NoOwed ELSE [b |-> before, s |-> after]
E == Trace[i]
TagsOf(tg) == IF tg = {"all"} THEN Tags ELSE tg       \* tags=None on the wire: every tag
Levels(lvl) == IF lvl = 0 THEN {1, 2} ELSE {lvl}
TagChoices(tg) == IF tg = {Unlogged} THEN {{Weights}, {KV}, Tags} ELSE {TagsOf(tg)}

(* A long trace is replayed in chunks (trace_export.split). A chunk after the first starts
   from the state the previous one ended in (Carried: TLC printed it, the checker pastes
   it into TraceData) with an empty network and empty histories; a chunk that is not the
   last must end quiescent, so that nothing dropped at the cut could still matter. *)
CarriedInit ==
    /\ wstate = Carried.wstate /\ alive = Carried.alive /\ wasleep = Carried.wasleep
    /\ wvalid = Carried.wvalid /\ wepoch = Carried.wepoch
    /\ wpend = [r \in Ranks |-> NoPend] /\ wcache = [r \in Ranks |-> {}]
    /\ replied = [r \in Ranks |-> {}] /\ applied = [r \in Ranks |-> [t \in TaskIds |-> 0]]
    /\ sstate = Carried.sstate /\ sepoch = Carried.sepoch /\ stask = 0 /\ scmd = NoCmd
    /\ sacks = Carried.sacks /\ sloadFailed = {} /\ sasleep = Carried.sasleep /\ svalid = Carried.svalid
    /\ sreqs = {} /\ sreqReplies = NoReplies /\ sreqErr = NoErrors /\ failedRanks = Carried.failedRanks
    /\ outcome = [t \in TaskIds |-> "none"] /\ nextTask = 1
    /\ net = {} /\ faults = 0 /\ broken = {}

TraceInit ==
    /\ \/ FromStart /\ Init
       \/ ~FromStart /\ CarriedInit
    /\ i = 1
    /\ owedState = NoOwed
    /\ owedSends = {}
    /\ wowed = [r \in Ranks |-> NoOwed]

Advance == i' = i + 1
EngineFree == owedState = NoOwed /\ owedSends = {}
OweStage == owedState' = Change(sstate, sstate')
OweSends == owedSends' = {m \in net' \ net : m.kind = "cmd"}
OweWorker(r) == wowed' = [wowed EXCEPT ![r] = Change(wstate[r], wstate'[r])]
WorkerFree(r) == wowed[r] = NoOwed

-----------------------------------------------------------------------------
(* ============================== engine lines ============================ *)

(* "recv": the orchestrator takes a reply (Ack, Nack, Result) or a Hello. *)
EngineRecv ==
    /\ E.k = "recv" /\ EngineFree /\ sstate = E.s
    /\ \E m \in net :
          /\ m.kind = E.c /\ m.task = E.t /\ m.rank = E.r /\ m.epoch = E.e
          /\ E.w # Unlogged => m.state = E.w
          /\ E.x # Unlogged => m.info = E.x
          /\ \E keep \in BOOLEAN : StageReceive(m, keep)     \* keep: see Resent
    /\ OweStage /\ OweSends
    /\ UNCHANGED wowed
    /\ Advance

(* A lifecycle command: the orchestrator's call, as the spec issues it. *)
Issue(c, lvl, tg) ==
    \/ c \in {"Sleep", Unlogged} /\ \E l \in Levels(lvl), t \in TagChoices(tg) : IssueSleep(l, t)
    \/ c \in {"Wake", Unlogged} /\ \E t \in TagChoices(tg) : IssueWake(t)
    \/ c \in {"ReloadWeights", Unlogged} /\ IssueReload

(* "state": the stage changed state. Either the change a step already made (owed), or a
   step of its own: a restart, a new lifecycle task, or a deadline (which logs nothing
   else). *)
EngineState ==
    /\ E.k = "state"
    /\ \/ /\ owedState = [b |-> E.b, s |-> E.s] /\ sepoch = E.e
          /\ owedState' = NoOwed
          /\ UNCHANGED <<vars, owedSends, wowed>>
       \/ /\ EngineFree /\ sstate = E.b
          /\ \/ /\ E.x = "restart" /\ Restart
                /\ wowed' = [r \in Ranks |-> NoOwed]     \* the old processes are gone
             \/ /\ E.x # "restart" /\ E.t = nextTask /\ Issue(E.c, E.lvl, E.tg)
                /\ UNCHANGED wowed
             \/ /\ E.x # "restart" /\ E.t # nextTask /\ Deadline
                /\ UNCHANGED wowed
          /\ sstate' = E.s /\ sepoch' = E.e
          /\ owedState' = NoOwed
          /\ OweSends
    /\ Advance

(* A retry with the same task id re-sends the command to the ranks that have not
   answered; an identical message again is what the spec's network duplication is
   (Deliver with keep = TRUE), so a re-send is replayed as one: the copy stays on the
   network when the first one is received (and its cached reply when the engine takes the
   first), within the "dup" budget the projection counts from the re-sent lines. *)
Resent(fits(_)) == "dup" \in Faults /\ \E m \in net \ owedSends : fits(m)

(* "send": the first send of a request issues it (Execute goes to every rank at once);
   any other send logs one of the commands a step put on the network. *)
EngineSend ==
    /\ E.k = "send" /\ owedState = NoOwed /\ sstate = E.s /\ sepoch = E.e
    /\ LET fits(m) == /\ m.kind = "cmd" /\ m.type = E.c /\ m.task = E.t /\ m.rank = E.r
                      /\ m.epoch = E.e
                      /\ E.lvl # 0 => m.level = E.lvl
                      /\ E.tg # {Unlogged} => m.tags = TagsOf(E.tg)
       IN \/ /\ E.c = "Execute" /\ E.t = nextTask /\ owedSends = {}
             /\ IssueExecute
             /\ \E m \in net' \ net : fits(m) /\ owedSends' = (net' \ net) \ {m}
          \/ /\ \E m \in owedSends : fits(m) /\ owedSends' = owedSends \ {m}
             /\ UNCHANGED vars
          \/ /\ Resent(fits)
             /\ UNCHANGED <<vars, owedSends>>
    /\ UNCHANGED <<owedState, wowed>>
    /\ Advance

(* "rank_died": the orchestrator saw rank E.r's process end (StageCore.on_rank_died);
   a stage already FAILED or STOPPED ignores it. *)
EngineDied ==
    /\ E.k = "died" /\ EngineFree /\ sstate = E.s /\ sepoch = E.e /\ ~alive[E.r]
    /\ IF sstate \in {"FAILED", "STOPPED"} THEN UNCHANGED vars ELSE RankDied(E.r)
    /\ OweStage /\ OweSends
    /\ UNCHANGED wowed
    /\ Advance

(* The kill itself is in no line (a killed process writes nothing): the spec's Crash,
   taken right before the death is seen. *)
HiddenCrash ==
    /\ i <= Len(Trace) /\ E.k = "died" /\ alive[E.r]
    /\ Crash(E.r)
    /\ wowed' = [wowed EXCEPT ![E.r] = NoOwed]
    /\ UNCHANGED <<i, owedState, owedSends>>

-----------------------------------------------------------------------------
(* ============================== worker lines ============================ *)

(* "start": the rank loaded its runner (ACTIVE), or loading raised (FAILED); the Hello,
   carrying that state, goes out. *)
WorkerStart ==
    /\ E.k = "start" /\ WorkerFree(E.r) /\ wepoch[E.r] = E.e
    /\ (Loaded(E.r) \/ LoadFailed(E.r))
    /\ wstate'[E.r] = E.w
    /\ UNCHANGED <<owedState, owedSends, wowed>>
    /\ Advance

(* "recv:<Command>": WorkerCore.on_command, logged with the state before it. The engine
   logs a send before the command leaves, so an unlogged command cannot be received. *)
WorkerRecv ==
    /\ E.k = "wrecv" /\ WorkerFree(E.r) /\ wstate[E.r] = E.w
    /\ \E m \in net \ owedSends :
          /\ m.kind = "cmd" /\ m.type = E.c /\ m.task = E.t /\ m.rank = E.r /\ m.epoch = E.e
          /\ \E keep \in BOOLEAN : WorkerReceive(E.r, m, keep)   \* keep: see Resent
    /\ OweWorker(E.r)
    /\ UNCHANGED <<owedState, owedSends>>
    /\ Advance

(* "done:<Command>" / "error:<Command>": the effect finished or raised, logged with the
   state after it. *)
WorkerDone ==
    /\ E.k \in {"done", "error"} /\ WorkerFree(E.r)
    /\ wpend[E.r].task = E.t /\ wpend[E.r].type = E.c
    /\ IF E.k = "done" THEN Done(E.r) ELSE EffectError(E.r)
    /\ wstate'[E.r] = E.w
    /\ OweWorker(E.r)
    /\ UNCHANGED <<owedState, owedSends>>
    /\ Advance

(* "state" of a worker: logs the change its last step made. *)
WorkerState ==
    /\ E.k = "wstate" /\ wowed[E.r] = [b |-> E.b, s |-> E.w]
    /\ wowed' = [wowed EXCEPT ![E.r] = NoOwed]
    /\ UNCHANGED <<vars, owedState, owedSends>>
    /\ Advance

(* "send:<Reply>": a reply (or Hello) of that kind for that task left this rank. *)
WorkerSend ==
    /\ E.k = "wsend" /\ WorkerFree(E.r)
    /\ IF E.c = "hello"
       THEN wepoch[E.r] = E.e /\ wstate[E.r] # "LOADING"     \* Loaded sent it
       ELSE \E m \in replied[E.r] : m.kind = E.c /\ m.task = E.t /\ m.epoch = E.e
    /\ UNCHANGED <<vars, owedState, owedSends, wowed>>
    /\ Advance

-----------------------------------------------------------------------------

TraceNext ==
    \/ /\ i <= Len(Trace)
       /\ \/ EngineRecv \/ EngineState \/ EngineSend \/ EngineDied
          \/ WorkerStart \/ WorkerRecv \/ WorkerDone \/ WorkerState \/ WorkerSend
    \/ HiddenCrash

TraceSpec == TraceInit /\ [][TraceNext]_<<vars, traceVars>>

(* Violated exactly when the whole trace has been replayed and the engine owes no line
   (and, for a chunk that is not the last, nothing is in flight):
   TLC's "Invariant TraceAccepted is violated" means ACCEPTED. *)
Quiescent ==
    /\ stask = 0 /\ sreqs = {}
    /\ \A r \in Ranks : wpend[r] = NoPend /\ wowed[r] = NoOwed
    /\ \A m \in net : m.epoch # sepoch             \* older epochs' messages can reach no one

TraceAccepted == ~(i > Len(Trace) /\ owedState = NoOwed /\ owedSends = {} /\ (ChunkEnd => Quiescent))

(* A state constraint that prints how far each state got (and the spec's view there):
   after a run that does not violate TraceAccepted, the highest index is where the trace
   diverged. Ranks are 0..N-1. *)
RankList(f) == [k \in 1..Cardinality(Ranks) |-> f[k - 1]]
TraceProgress ==
    PrintT(<<"@trace", i, sstate, sepoch, RankList(wstate), RankList(alive), owedState.s,
             Cardinality(owedSends), RankList([r \in Ranks |-> wowed[r].s])>>)

=============================================================================
