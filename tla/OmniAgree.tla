------------------------------- MODULE OmniAgree -------------------------------
(***************************************************************************)
(* The spec's own actions, applied once to every small case, printed for   *)
(* formal/agree.py to replay on the Python cores (`omni-core check` runs   *)
(* it first): what OmniSleep's WorkerReceive/OnCommand and Done do for     *)
(* every (worker state, asleep tags, weights valid, pending effect, reply  *)
(* cache, command kind/level/tags, epoch and task relation), and what      *)
(* IssueSleep/IssueWake/IssueReload and Expect give for every settled      *)
(* stage residency. Nothing here restates the spec: each line is the       *)
(* result of one real action step.                                         *)
(*                                                                         *)
(* One rank (r1) at epoch 1: a command of epoch 0 is stale. Task 1 is the  *)
(* pending effect's, task 2 the cached one's, task 3 a fresh one.          *)
(*                                                                         *)
(* Replies too: after a lifecycle call that sent something, a second step  *)
(* takes one reply with StageReceive (well-formed, wrong state or asleep   *)
(* tags, another epoch, an unknown task, each refusal): what the stage     *)
(* does with an ACK is the spec's, not only what it sends.                 *)
(***************************************************************************)
EXTENDS OmniSleep, Sequences

VARIABLES
    stepped,    \* one step per case: the cases are the initial states
    rcase,      \* a reply case: the reply the stage takes after the call (NoReply: none)
    delivered   \* that reply taken

R == CHOOSE r \in Ranks : TRUE
CachedMark == "CACHED"   \* the reply a cache hit must return unchanged

Consistent(ws, a, v) ==
    CASE ws \in {"LOADING", "ACTIVE"} -> a = {} /\ v
      [] ws \in {"SLEEPING", "PARTIAL", "RESTORING"} -> a # {}
      [] ws = "NEEDS_RELOAD" -> Weights \notin a /\ ~v /\ Weights \in Tags
      [] ws = "RELOADING" -> Weights \notin a /\ (v => a = {})
      [] OTHER -> TRUE
NonEmpty(s) == (SUBSET s) \ {{}}
PendRec(t, type, l, p, o) == [task |-> t, type |-> type, level |-> l, plan |-> p, offload |-> o]
Pends(ws, a, v) ==
    CASE ws = "OFFLOADING" -> {PendRec(1, "Sleep", l, p, SleepOffload(l, p, v)) : l \in {1, 2}, p \in NonEmpty(Tags \ a)}
      [] ws = "RESTORING" -> {PendRec(1, "Wake", 0, p, {}) : p \in NonEmpty(a)}
      [] ws = "RELOADING" -> {PendRec(1, "ReloadWeights", 0, {}, {})}
      [] ws = "ACTIVE" -> {NoPend, PendRec(1, "Execute", 0, {}, {})}
      [] OTHER -> {NoPend}
WorkerCases ==
    UNION {{[st |-> ws, asl |-> a, val |-> v, pend |-> p, cached |-> c] : p \in Pends(ws, a, v)} :
           ws \in WorkerStates \ {"STOPPED"}, a \in SUBSET Tags, v \in BOOLEAN, c \in BOOLEAN}
ConsistentCases == {w \in WorkerCases : Consistent(w.st, w.asl, w.val)}

Shapes == {[type |-> "Sleep", level |-> l, tags |-> TagSet(g)] : l \in {1, 2}, g \in {"all"} \cup Tags}
          \cup {[type |-> "Wake", level |-> 0, tags |-> TagSet(g)] : g \in {"all"} \cup Tags}
          \cup {[type |-> ty, level |-> 0, tags |-> {}] : ty \in {"ReloadWeights", "Execute"}}
Commands(w) ==
    {CmdMsg(s.type, t, e, R, s.level, s.tags) : s \in Shapes, t \in (IF w.cached THEN {2, 3} ELSE {3}),
                                                e \in {0, 1}}
    \cup {CmdMsg("Execute", 3, e, R, 0, {}) : e \in {1 + MaxEpochAhead, 2 + MaxEpochAhead}}   \* the window's edge
    \cup (IF w.pend = NoPend THEN {}      \* a copy of the command in progress: the same command
          ELSE {CmdMsg(w.pend.type, 1, e, R, w.pend.level, w.pend.plan) : e \in {0, 1}})

StageCases ==
    {[st |-> ss, asl |-> a, val |-> v] : ss \in Settled, a \in SUBSET Tags, v \in BOOLEAN}
GoodStage(s) ==
    CASE s.st = "RUNNING" -> s.asl = {} /\ s.val
      [] s.st = "SLEEPING" -> s.asl # {}
      [] s.st = "PARTIAL" -> s.asl # {}
      [] s.st = "NEEDS_RELOAD" -> Weights \notin s.asl /\ ~s.val
Calls == {[type |-> "Sleep", level |-> l, tags |-> TagSet(g)] : l \in {1, 2}, g \in {"all"} \cup Tags}
         \cup {[type |-> "Wake", level |-> 0, tags |-> TagSet(g)] : g \in {"all"} \cup Tags}
         \cup {[type |-> "ReloadWeights", level |-> 0, tags |-> {}]}

Base(ws, a, v, p, cache, n, ss, sa, sv) ==
    /\ mem = [r \in Ranks |-> MemFrom(a, v)]
    /\ wstate = [r \in Ranks |-> ws] /\ alive = [r \in Ranks |-> TRUE]
    /\ wasleep = [r \in Ranks |-> a] /\ wvalid = [r \in Ranks |-> v] /\ wepoch = [r \in Ranks |-> 1]
    /\ wpend = [r \in Ranks |-> p] /\ wcache = [r \in Ranks |-> cache]
    /\ replied = [r \in Ranks |-> {}] /\ applied = [r \in Ranks |-> [t \in TaskIds |-> 0]]
    /\ sstate = ss /\ sepoch = 1 /\ stask = 0 /\ scmd = NoCmd /\ sacks = Ranks /\ sloadFailed = {}
    /\ sasleep = sa /\ svalid = sv /\ sreqs = {} /\ sreqReplies = NoReplies /\ sreqErr = NoErrors
    /\ failedRanks = {} /\ outcome = [t \in TaskIds |-> "none"] /\ nextTask = 1
    /\ net = n /\ faults = 0 /\ broken = {}
    /\ wprof = [r \in Ranks |-> FALSE] /\ sprof = NoProf   \* Profile is not in the agreement cases
    /\ stepped = FALSE /\ delivered = FALSE

NoReply == [from |-> "-", kind |-> "none", info |-> "-", state |-> "-", asleep |-> {}, task |-> 0, epoch |-> 0]
ReplyRec(from, k, i, st, a, t, e) == [from |-> from, kind |-> k, info |-> i, state |-> st, asleep |-> a, task |-> t,
                                      epoch |-> e]
(* Well-formed in shape, every state and asleep set; another epoch and an unknown task; each
   refusal. Task 1 is the call's, epoch 1 the stage's. *)
Replies(from) ==
    {ReplyRec(from, "ack", i, st, a, 1, 1) : i \in {"OK", "ALREADY"},
                                            st \in {"ACTIVE", "SLEEPING", "PARTIAL", "NEEDS_RELOAD"}, a \in SUBSET Tags}
    \cup {ReplyRec(from, "ack", "OK", x[1], x[2], y[1], y[2]) : x \in {<<"ACTIVE", {}>>, <<"SLEEPING", Tags>>},
                                                                y \in {<<1, 0>>, <<1, 2>>, <<3, 1>>}}
    \cup {ReplyRec(from, "nack", i, st, {}, 1, 1) : i \in {"INVALID_STATE", "INVALID_ARGUMENT", "NO_MEMORY", "BUSY"},
                                                  st \in {"ACTIVE", "SLEEPING"}}
ReplyMsg(x) == Msg(x.kind, scmd.type, x.task, x.epoch, R, 0, {}, x.state, x.asleep, x.info)

CacheOf(w, m) == IF w.cached THEN {AckMsg(m.type, 2, 1, R, "ACTIVE", {}, CachedMark)} ELSE {}

CallMsg(c) == [CmdMsg(c.type, 0, 0, R, c.level, c.tags) EXCEPT !.kind = "call"]
AgreeInit ==
    \/ \E w \in ConsistentCases : \E m \in Commands(w) :
          Base(w.st, w.asl, w.val, w.pend, CacheOf(w, m), {m}, "RUNNING", {}, TRUE) /\ rcase = NoReply
    \/ \E s \in StageCases : \E c \in Calls :
          /\ GoodStage(s)
          /\ Base("ACTIVE", {}, TRUE, NoPend, {}, {CallMsg(c)}, s.st, s.asl, s.val)
          /\ rcase \in {NoReply} \cup Replies(s.st)

Call == CHOOSE m \in net : TRUE
TheCall == CHOOSE m \in net : m.kind = "call"
AgreeNext ==
    \/ /\ ~stepped /\ stepped' = TRUE /\ UNCHANGED <<rcase, delivered>>
       /\ \/ \E m \in net : m.kind = "cmd" /\ WorkerReceive(R, m, FALSE)
          \/ \E m \in net : m.kind = "cmd" /\ Done(R)
          \/ /\ Call.kind = "call"
             /\ \/ Call.type = "Sleep" /\ IssueSleep(Call.level, Call.tags)
                \/ Call.type = "Wake" /\ IssueWake(Call.tags)
                \/ Call.type = "ReloadWeights" /\ IssueReload
    \/ /\ stepped /\ ~delivered /\ rcase # NoReply /\ stask # 0    \* the call sent something
       /\ delivered' = TRUE /\ UNCHANGED <<stepped, rcase>>
       /\ StageReceive(ReplyMsg(rcase), FALSE)

(* ---- what is printed: flat tuples of strings, numbers, booleans and sets *)
WCase == <<wstate[R], wasleep[R], wvalid[R], wpend[R].task, wpend[R].type, wpend[R].level, wpend[R].plan,
           wcache[R] # {}>>
MCase(m) == <<m.type, m.level, m.tags, m.task, m.epoch>>
SCase == <<sstate, sasleep, svalid>>
Reply(msgs) == IF msgs = {} THEN <<"none", "-", "-", {}>>
               ELSE LET x == CHOOSE y \in msgs : TRUE IN <<x.kind, x.info, x.state, x.asleep>>

(* Each initial state is a case (an invariant sees every one)... *)
PrintCases ==
    ~stepped =>
        LET m == CHOOSE y \in net : TRUE IN
        IF m.kind = "cmd" THEN PrintT(<<"AGREE", "case", WCase, MCase(m)>>)
        ELSE PrintT(<<"AGREE", "scase", SCase, <<m.type, m.level, m.tags>>>>)

(* ... and each of its steps a result (an action constraint sees every transition). *)
PrintSteps ==
    LET m == CHOOSE y \in net : TRUE
        sent == {x \in net' : x.kind \notin {"cmd", "call"}}
    IN IF delivered' /\ ~delivered THEN
          PrintT(<<"AGREE", "reply", <<rcase.from, sasleep, svalid>>, <<TheCall.type, TheCall.level, TheCall.tags>>,
                   <<rcase.kind, rcase.info, rcase.state, rcase.asleep, rcase.task, rcase.epoch>>,
                   <<sstate', failedRanks' # {}, outcome'[1], sasleep', svalid'>>>>)
       ELSE IF m.kind = "call" THEN
          PrintT(<<"AGREE", "issue", SCase, <<m.type, m.level, m.tags>>,
                   <<sstate', {x.type : x \in {y \in net' : y.kind = "cmd"}}, outcome'[1],
                     IF stask' = 0 THEN <<"-", {}, FALSE, "-">>
                     ELSE <<Expect'.wstate, Expect'.asleep, Expect'.valid, Expect'.trigger>>>>>>)
       ELSE IF wpend[R] # NoPend /\ wpend'[R] = NoPend THEN
          PrintT(<<"AGREE", "done", WCase, <<wstate'[R], wasleep'[R], wvalid'[R]>> \o Reply(sent)>>)
       ELSE
          PrintT(<<"AGREE", "recv", WCase, MCase(m),
                   <<wstate'[R], wpend'[R].type, wpend'[R].plan, wpend'[R].offload, wcache'[R] # wcache[R],
                     applied'[R][m.task] > 0>> \o Reply(sent)>>)
=============================================================================
