------------------------------- MODULE OmniWeights -------------------------------
(***************************************************************************)
(* P-17's weight commands on OmniSleep's variables, for the trace spec:   *)
(* UpdateWeights (a versioned update), InitWeightGroup, ShareWeights and   *)
(* ResetPrefixCache, P-19 (tasks that change no state). OmniSleep itself   *)
(* has no action for them; this module adds them beside it, with the      *)
(* weights versions:                                                       *)
(*   wver[r]  the version rank r holds (a fresh process: 0, its own)       *)
(*   sver     the version the stage committed last                          *)
(*   uver     the version of the update in flight (on the wire: its level)  *)
(*   uans[r]  rank r's answer to it: none, ack, refused, failed            *)
(*   ufrom    the settled state the update started in                      *)
(*   wtask    a stateless weight task in flight (0: none); wsaid: answered *)
(* Legality and next states come from the generated tables (OmniTransitions:*)
(* update, update_drain/update_drained, update_refused_*, update_failed,   *)
(* weight_group, share), as everywhere in OmniSleep. What holds is what    *)
(* OmniVersions.tla checks on its own model, here along a real run: an     *)
(* update goes above the committed version, a rank writes what was sent   *)
(* and reports it, the stage commits only when every rank ACKed that       *)
(* version, a rank that failed once writing began is NEEDS_RELOAD at the   *)
(* version it had (the stage follows when all failed, FAILED on a mix),   *)
(* and no request runs on a version other than the committed one.          *)
(*                                                                         *)
(* Not modelled (a trace diverges there): an update's drain that passes   *)
(* its deadline, an InitWeightGroup answered ALREADY, the error of a      *)
(* stateless weight task, a deadline on one.                               *)
(***************************************************************************)
EXTENDS OmniSleep

VARIABLES wver, sver, uver, uans, ufrom, wtask, wsaid
weightVars == <<wver, sver, uver, uans, ufrom, wtask, wsaid>>
(* What the last restart started the ranks from (StageRestarted): `sneeds`, their weights
   loaded but not to be served (NEEDS_RELOAD: the version lived in memory only, or the
   runner's weights are dummy); `sfloor`, the version the stage must not serve below. Only a
   restart changes them (OmniTrace's TraceNext). *)
VARIABLES sneeds, sfloor
floorVars == <<sneeds, sfloor>>

(* The LoRA adapter commands (P-20) are stateless tasks too: an ALREADY answer is not modelled. *)
AdapterCommands == {"AddAdapter", "RemoveAdapter", "PinAdapter", "ListAdapters"}
(* SaveWeights (P-21) is one too: the stage records where its version lives, which the trace's
   next restart names (StageRestarted's version); nothing here moves. So are the stage-to-stage
   transfer commands (P-22): a producer's holds are OmniTransfers'. *)
TransferCommands == {"TransferOut", "TransferIn", "TransferRelease"}
WeightCommands == {"UpdateWeights", "InitWeightGroup", "ShareWeights", "ResetPrefixCache", "SaveWeights"}
                  \cup AdapterCommands \cup TransferCommands
Stateless == {"InitWeightGroup", "ShareWeights", "ResetPrefixCache", "SaveWeights"} \cup AdapterCommands
             \cup TransferCommands
Trigger == [UpdateWeights |-> "update", InitWeightGroup |-> "weight_group", ShareWeights |-> "share",
            ResetPrefixCache |-> "reset_prefix_cache", SaveWeights |-> "save_weights", AddAdapter |-> "add_adapter",
            RemoveAdapter |-> "remove_adapter", PinAdapter |-> "pin_adapter", ListAdapters |-> "list_adapters",
            TransferOut |-> "transfer_out", TransferIn |-> "transfer_in", TransferRelease |-> "transfer_release"]
NoAnswers == [r \in Ranks |-> "none"]
Range(f) == {f[x] : x \in DOMAIN f}
(* The trigger a refused update fires, by where it was refused (the stage's; the rank's). *)
StageRefusedUpdate == [RUNNING |-> "update_refused_running", PARTIAL |-> "update_refused_partial",
                       NEEDS_RELOAD |-> "update_refused_needs_reload"]
RankRefusedUpdate == [active |-> "update_refused_active", partial |-> "update_refused_partial",
                      needs_reload |-> "update_refused_needs_reload"]
(* Where an update leaves a rank and the stage: every tag as before, the weights valid. *)
Updated(asleep) == Settle(asleep, TRUE)

WeightsInit(fromStart, carried) ==
    /\ wver = IF fromStart THEN [r \in Ranks |-> 0] ELSE carried.wver
    /\ sver = IF fromStart THEN 0 ELSE carried.sver
    /\ uver = 0 /\ uans = NoAnswers /\ ufrom = NoVal /\ wtask = 0 /\ wsaid = {}

FloorInit(fromStart, carried) ==
    /\ sneeds = IF fromStart THEN FALSE ELSE carried.sneeds
    /\ sfloor = IF fromStart THEN 0 ELSE carried.sfloor

WeightsTypeOK ==
    /\ wver \in [Ranks -> Nat] /\ sver \in Nat /\ uver \in Nat
    /\ uans \in [Ranks -> {"none", "ack", "refused", "failed"}]
    /\ wtask \in TaskIds \cup {0} /\ wsaid \subseteq Ranks
    /\ sneeds \in BOOLEAN /\ sfloor \in Nat

-----------------------------------------------------------------------------
(* ============================== orchestrator ============================ *)

(* update_weights(v): v above the committed version (else the call is refused before any
   task). In RUNNING admission closes and the requests in flight finish first (OmniSleep's
   EndRequest sends the update when the last one ends); with none, at once. *)
IssueUpdate(v) ==
    /\ Idle /\ wtask = 0 /\ nextTask \in TaskIds /\ v > sver
    /\ v >= sfloor      \* below the version floor the call is refused (VersionKeeper.refusal_below_floor)
    /\ LET t == nextTask
           now == ~SLegal(sstate, "update_drain") \/ sreqs = {}
       IN /\ \/ SLegal(sstate, "update_drain")
                /\ sstate' = IF sreqs = {} THEN SNext(SNext(sstate, "update_drain"), "update_drained")
                             ELSE SNext(sstate, "update_drain")
             \/ ~SLegal(sstate, "update_drain") /\ SLegal(sstate, "update")
                /\ sstate' = SNext(sstate, "update")
          /\ net' = IF now THEN net \cup SendAll("UpdateWeights", t, v, {}) ELSE net  \* the version as the level
          /\ stask' = t /\ scmd' = [type |-> "UpdateWeights", level |-> v, tags |-> {}] /\ sacks' = {}
          /\ outcome' = Pending(t)
    /\ uver' = v /\ uans' = NoAnswers /\ ufrom' = sstate
    /\ nextTask' = nextTask + 1
    /\ UNCHANGED <<sepoch, sloadFailed, sasleep, svalid, sreqs, sreqReplies, sreqErr, failedRanks,
                   workerVars, faults, broken, sprof, wver, sver, wtask, wsaid>>

(* InitWeightGroup, ShareWeights, ResetPrefixCache: a task in a settled state that the answers never move
   (StageCore's STATELESS commands); requests go on meanwhile. *)
IssueWeightTask(type) ==
    /\ Idle /\ wtask = 0 /\ nextTask \in TaskIds /\ SLegal(sstate, Trigger[type])
    /\ LET t == nextTask IN
       /\ sstate' = SNext(sstate, Trigger[type])
       /\ net' = net \cup SendAll(type, t, 0, {})
       /\ wtask' = t /\ wsaid' = {}
       /\ outcome' = Pending(t)
    /\ nextTask' = nextTask + 1
    /\ UNCHANGED <<sepoch, stask, scmd, sacks, sloadFailed, sasleep, svalid, sreqs, sreqReplies, sreqErr,
                   failedRanks, workerVars, faults, broken, sprof, wver, sver, uver, uans, ufrom>>

UpdateEnds(said, netNext) ==
    /\ sacks' = said /\ stask' = 0 /\ scmd' = NoCmd /\ net' = netNext
    /\ UNCHANGED <<sepoch, sloadFailed, sasleep, sreqs, sreqReplies, sreqErr, failedRanks, sprof>>

(* Every rank answered the update: StageCore._maybe_commit. *)
SettleUpdate(ans, said, netNext) ==
    LET answers == Range(ans)
        named(a) == {r \in Ranks : ans[r] = a}
    IN CASE answers = {"ack"} ->        \* commit: the version, the weights valid (P-5)
              /\ sstate' = SNext(sstate, WakeCommit[Updated(sasleep)])
              /\ svalid' = TRUE /\ sver' = uver
              /\ outcome' = [outcome EXCEPT ![stask] = "ok"]
              /\ UpdateEnds(said, netNext)
         [] answers = {"failed"} ->     \* every rank NEEDS_RELOAD at the version it had
              /\ sstate' = SNext(sstate, "update_failed")
              /\ svalid' = FALSE /\ sver' = sver
              /\ outcome' = [outcome EXCEPT ![stask] = "failed"]
              /\ UpdateEnds(said, netNext)
         [] answers = {"refused"} ->    \* nothing was written: back where it started
              /\ sstate' = SNext(sstate, StageRefusedUpdate[ufrom])
              /\ svalid' = svalid /\ sver' = sver
              /\ outcome' = [outcome EXCEPT ![stask] = "refused"]
              /\ UpdateEnds(said, netNext)
         [] OTHER ->                    \* ranks now hold different weights
              /\ FailStage(IF named("failed") # {} THEN named("failed") ELSE named("refused"), netNext)
              /\ UNCHANGED sver

(* A reply to the update in flight; `ver` is the version the rank reported. An ACK must be
   of the version sent, in the state and with the tags the update leaves; a failure must
   leave the rank NEEDS_RELOAD; any other refusal fails the stage (P-9). *)
UpdateReply(m, ver, rest) ==
    LET answer == CASE m.kind = "nack" /\ m.info = "INVALID_ARGUMENT" -> "refused"
                    [] m.kind = "nack" /\ m.info = "UPDATE_FAILED" /\ m.state = "NEEDS_RELOAD" -> "failed"
                    [] m.kind = "ack" /\ ver = uver /\ m.state = RankState[Updated(sasleep)]
                                      /\ m.asleep = sasleep -> "ack"
                    [] OTHER -> "bad"
        said == sacks \cup {m.rank}
        ans == [uans EXCEPT ![m.rank] = answer]
    IN IF answer = "bad" THEN FailStage({m.rank}, rest) /\ UNCHANGED <<sver, uans>>
       ELSE IF said # Ranks
       THEN /\ sacks' = said /\ uans' = ans /\ net' = rest
            /\ UNCHANGED <<sstate, sepoch, stask, scmd, sloadFailed, sasleep, svalid, sreqs, sreqReplies,
                           sreqErr, failedRanks, outcome, sprof, sver>>
       ELSE SettleUpdate(ans, said, rest) /\ uans' = ans

(* A reply to a stateless weight task (StageCore._on_profile_reply): the rank must still be
   where the stage committed it; once every rank answered the task ends, the state stays. *)
WeightTaskReply(m, rest) ==
    IF m.state # RankOfStage(sstate) \/ (m.kind = "ack" /\ m.asleep # sasleep)
    THEN FailStage({m.rank}, rest) /\ wtask' = 0 /\ wsaid' = {}
    ELSE LET said == wsaid \cup {m.rank} IN
         /\ wsaid' = IF said = Ranks THEN {} ELSE said
         /\ wtask' = IF said = Ranks THEN 0 ELSE wtask
         /\ outcome' = IF said = Ranks THEN [outcome EXCEPT ![wtask] = "ok"] ELSE outcome
         /\ net' = rest
         /\ UNCHANGED <<sstate, sepoch, stask, scmd, sacks, sloadFailed, sasleep, svalid, sreqs,
                        sreqReplies, sreqErr, failedRanks, sprof>>

ForUpdate(m) == stask # 0 /\ scmd.type = "UpdateWeights" /\ m.task = stask /\ m.kind \in {"ack", "nack"}
ForWeightTask(m) == wtask # 0 /\ m.task = wtask /\ m.kind \in {"ack", "nack"}

(* A reload brings its source's weights back: once the stage commits it, its version is the one
   the last rank's ACK reports, `ver` (0 for the runner's own, a save's for a saved directory,
   P-21; every rank the same, or the stage fails: W_SettledOnCommitted). *)
ReloadCommitted(ver) ==
    sver' = IF stask # 0 /\ scmd.type = "ReloadWeights" /\ outcome'[stask] = "ok" THEN ver ELSE sver

(* StageCore on_hello after a restart that planned NEEDS_RELOAD (StartWeights.needs_reload):
   every rank must say Hello NEEDS_RELOAD; then the stage is NEEDS_RELOAD, its weights not
   valid (started_needs_reload). A rank in any other state fails the start, naming it. *)
HelloNeedsReload(m, keep) ==
    /\ keep => FaultOk("dup")
    /\ LET rest == IF keep THEN net ELSE net \ {m}
           said == sacks \cup {m.rank}
           bad == IF m.state = "NEEDS_RELOAD" THEN sloadFailed \ {m.rank} ELSE sloadFailed \cup {m.rank}
       IN IF said = Ranks /\ bad # {}
          THEN FailStage(bad, rest)
          ELSE IF said = Ranks
          THEN /\ sstate' = SNext(sstate, "started_needs_reload") /\ sacks' = said /\ svalid' = FALSE
               /\ net' = rest
               /\ UNCHANGED <<sepoch, stask, scmd, sloadFailed, sasleep, sreqs, sreqReplies, sreqErr,
                              failedRanks, outcome, sprof>>
          ELSE /\ sacks' = said /\ sloadFailed' = bad /\ net' = rest
               /\ UNCHANGED <<sstate, sepoch, stask, scmd, sasleep, svalid, sreqs, sreqReplies, sreqErr,
                              failedRanks, outcome, sprof>>
    /\ faults' = IF keep THEN faults + 1 ELSE faults
    /\ UNCHANGED <<workerVars, nextTask, broken>>

(* The stage takes reply m (the record says the rank reported version `ver`): a weight task's
   reply here, any other in OmniSleep's StageReceive. A second answer of a rank is ignored. *)
StageTake(m, keep, ver) ==
    IF m.kind = "hello" /\ m.epoch = sepoch /\ sstate = "STARTING" /\ sneeds
    THEN HelloNeedsReload(m, keep) /\ UNCHANGED weightVars
    ELSE IF m.epoch = sepoch /\ (ForUpdate(m) \/ ForWeightTask(m))
    THEN /\ m.kind \in ReplyKinds
         /\ keep => FaultOk("dup")
         /\ LET rest == IF keep THEN net ELSE net \ {m} IN
            IF ForUpdate(m) /\ m.rank \in sacks THEN Ignore(rest) /\ UNCHANGED <<sver, uans>>
            ELSE IF ForWeightTask(m) /\ m.rank \in wsaid THEN Ignore(rest) /\ UNCHANGED <<wtask, wsaid>>
            ELSE IF ForUpdate(m) THEN UpdateReply(m, ver, rest) /\ UNCHANGED <<wtask, wsaid>>
            ELSE WeightTaskReply(m, rest) /\ UNCHANGED <<sver, uans>>
         /\ faults' = IF keep THEN faults + 1 ELSE faults
         /\ UNCHANGED <<workerVars, nextTask, broken, wver, uver, ufrom>>
    ELSE StageReceive(m, keep) /\ ReloadCommitted(ver) /\ UNCHANGED <<wver, uver, uans, ufrom, wtask, wsaid>>

-----------------------------------------------------------------------------
(* ================================ worker ================================ *)

(* WorkerCore.step(CommandReceived) for a weight command: the fence, the reply cache and BUSY as for
   every command, then the table; an update not above the rank's version is refused
   INVALID_ARGUMENT before anything is written. *)
OnWeights(r, m) ==
    IF m.epoch < wepoch[r] THEN Refuse(r, m, "STALE_EPOCH")
    ELSE IF m.epoch > wepoch[r] + MaxEpochAhead THEN Refuse(r, m, "EPOCH_AHEAD")
    ELSE IF wpend[r].task = m.task THEN Silent(r)
    ELSE IF Cached(r, m.task) THEN FromCache(r, m)
    ELSE IF Busy(r) THEN Refuse(r, m, "BUSY")
    ELSE IF wstate[r] = "FAILED" THEN Refuse(r, m, "FAILED")
    ELSE IF ~WLegal(wstate[r], Trigger[m.type]) THEN Refuse(r, m, "INVALID_STATE")
    ELSE IF m.type = "UpdateWeights" /\ m.level <= wver[r] THEN Refuse(r, m, "INVALID_ARGUMENT")
    ELSE Start(r, m, Trigger[m.type], {}, {})

(* The runner loaded, its weights not to be served (the worker table's loaded_needs_reload):
   the rank is NEEDS_RELOAD with its weights invalid, and says so in its Hello. *)
LoadedNeedsReload(r) ==
    /\ alive[r] /\ WLegal(wstate[r], "loaded_needs_reload")
    /\ wstate' = [wstate EXCEPT ![r] = WNext(@, "loaded_needs_reload")]
    /\ wvalid' = [wvalid EXCEPT ![r] = FALSE]
    /\ net' = net \cup {HelloMsg(wepoch[r], r, wstate'[r])}
    /\ UNCHANGED <<mem, alive, wasleep, wepoch, wpend, wprof, wcache, replied, applied, stageVars,
                   nextTask, faults, broken>>

(* A rank takes command m: a weight command here, any other in OmniSleep's WorkerReceive. *)
RankTake(r, m, keep) ==
    IF m.kind = "cmd" /\ m.type \in WeightCommands
    THEN /\ m.rank = r /\ alive[r]
         /\ SerialShell => ~Busy(r)
         /\ keep => FaultOk("dup")
         /\ LET o == OnWeights(r, m)
                changed == o.st # wstate[r] \/ o.pend # wpend[r]
            IN /\ wstate' = [wstate EXCEPT ![r] = o.st]
               /\ wpend' = [wpend EXCEPT ![r] = o.pend]
               /\ wcache' = IF o.cache THEN [wcache EXCEPT ![r] = @ \cup {o.reply}] ELSE wcache
               /\ replied' = IF Terminal(o.reply) THEN [replied EXCEPT ![r] = @ \cup {o.reply}] ELSE replied
               /\ applied' = IF o.apply THEN [applied EXCEPT ![r][m.task] = @ + 1] ELSE applied
               /\ net' = (IF keep THEN net ELSE net \ {m}) \cup (IF o.reply.kind = "none" THEN {} ELSE {o.reply})
               /\ broken' = broken
                     \cup (IF m.epoch < wepoch[r] /\ (changed \/ o.reply.info # "STALE_EPOCH") THEN {"P6"} ELSE {})
                     \cup (IF o.reply.kind = "nack" /\ changed THEN {"P11"} ELSE {})
         /\ faults' = IF keep THEN faults + 1 ELSE faults
         /\ UNCHANGED <<mem, alive, wasleep, wvalid, wepoch, wprof, stageVars, nextTask, weightVars>>
    ELSE WorkerReceive(r, m, keep) /\ UNCHANGED weightVars

RankAnswer(r, m) == IF m.kind = "cmd" /\ m.type \in WeightCommands THEN OnWeights(r, m).reply
                    ELSE OnCommand(r, m).reply

WeightPending(r) == wpend[r].type \in WeightCommands

(* The effect finished: an update wrote every bucket, so the rank holds the version sent
   with its weights valid and ACKs it; a stateless task changed nothing. *)
WeightDone(r) ==
    /\ alive[r] /\ Busy(r) /\ WeightPending(r)
    /\ LET p == wpend[r]
           update == p.type = "UpdateWeights"
           st == IF update THEN WNext(wstate[r], Reloaded[Updated(wasleep[r])]) ELSE wstate[r]
           reply == AckMsg(p.type, p.task, wepoch[r], r, st, wasleep[r], "OK")
       IN /\ wstate' = [wstate EXCEPT ![r] = st]
          /\ wvalid' = IF update THEN [wvalid EXCEPT ![r] = TRUE] ELSE wvalid
          /\ mem' = IF update THEN [mem EXCEPT ![r] = [t \in Tags |-> IF t = Weights THEN "valid" ELSE @[t]]]
                    ELSE mem
          /\ wver' = IF update THEN [wver EXCEPT ![r] = p.level] ELSE wver
          /\ wpend' = [wpend EXCEPT ![r] = NoPend]
          /\ wcache' = [wcache EXCEPT ![r] = @ \cup {reply}]
          /\ replied' = [replied EXCEPT ![r] = @ \cup {reply}]
          /\ net' = net \cup {reply}
    /\ UNCHANGED <<alive, wasleep, wepoch, wprof, applied, stageVars, nextTask, faults, broken,
                   sver, uver, uans, ufrom, wtask, wsaid>>

(* The update failed once writing began (UPDATE_FAILED): the weights are invalid, the rank
   NEEDS_RELOAD at the version it had, and says so. *)
WeightFailed(r) ==
    /\ alive[r] /\ Busy(r) /\ wpend[r].type = "UpdateWeights" /\ FaultOk("error")
    /\ LET p == wpend[r]
           st == WNext(wstate[r], "update_failed")
           reply == NackMsg(p.type, p.task, wepoch[r], r, "UPDATE_FAILED", st)
       IN /\ wstate' = [wstate EXCEPT ![r] = st]
          /\ wvalid' = [wvalid EXCEPT ![r] = FALSE]
          /\ mem' = [mem EXCEPT ![r] = [t \in Tags |-> IF t = Weights THEN "garbage" ELSE @[t]]]
          /\ wpend' = [wpend EXCEPT ![r] = NoPend]
          /\ wcache' = [wcache EXCEPT ![r] = @ \cup {reply}]
          /\ replied' = [replied EXCEPT ![r] = @ \cup {reply}]
          /\ net' = net \cup {reply}
    /\ faults' = faults + 1
    /\ UNCHANGED <<alive, wasleep, wepoch, wprof, applied, stageVars, nextTask, broken, weightVars>>

(* The runner refused the update's source before writing (a name, shape, dtype or handle:
   INVALID_ARGUMENT): back where it was, version unchanged. *)
WeightRefused(r) ==
    /\ alive[r] /\ Busy(r) /\ wpend[r].type = "UpdateWeights"
    /\ LET p == wpend[r]
           st == WNext(wstate[r], RankRefusedUpdate[Settle(wasleep[r], wvalid[r])])
           reply == NackMsg(p.type, p.task, wepoch[r], r, "INVALID_ARGUMENT", st)
       IN /\ wstate' = [wstate EXCEPT ![r] = st]
          /\ wpend' = [wpend EXCEPT ![r] = NoPend]
          /\ wcache' = [wcache EXCEPT ![r] = @ \cup {reply}]
          /\ replied' = [replied EXCEPT ![r] = @ \cup {reply}]
          /\ net' = net \cup {reply}
    /\ UNCHANGED <<mem, alive, wasleep, wvalid, wepoch, wprof, applied, stageVars, nextTask, faults, broken,
                   weightVars>>

(* A rank's reload effect finished: it holds the version of its source, `v` (EffectDone's):
   0 for the runner's own (P-17 rule 2), a save's for a saved directory (P-21), whatever update
   it held; any other effect of OmniSleep leaves its version. *)
RankReloaded(r, v) ==
    /\ wver' = IF wpend[r].type = "ReloadWeights" THEN [wver EXCEPT ![r] = v] ELSE wver
    /\ UNCHANGED <<sver, uver, uans, ufrom, wtask, wsaid>>

(* A restart replaces every rank by a fresh process: its own weights (version 0), or the
   version `v` of the directory the stage's committed version came from (StageRestarted);
   `needs`: the ranks start NEEDS_RELOAD under the version floor `floor`. *)
FloorRestarted(needs, floor) == sneeds' = needs /\ sfloor' = floor

WeightsRestarted(v) ==
    /\ wver' = [r \in Ranks |-> v] /\ sver' = v
    /\ uver' = 0 /\ uans' = NoAnswers /\ ufrom' = NoVal /\ wtask' = 0 /\ wsaid' = {}

-----------------------------------------------------------------------------
(* ============================== invariants ============================== *)

(* OmniVersions' NoMixedVersions and its commit rule, along the replay: a rank executes only
   the committed version, and a settled stage's live ranks hold it (a failed update leaves
   them at the version they had, which is still the committed one). *)
W_NoMixedVersions == \A r \in Ranks : Executing(r) => wver[r] = sver
W_SettledOnCommitted == sstate \in Settled => \A r \in Ranks : Live(r) => wver[r] = sver
(* A failed update never leaves a stage serving: the stage is NEEDS_RELOAD, FAILED or
   still waiting while a live rank's weights are invalid. *)
W_NoServingOnInvalid == \A r \in Ranks : Live(r) /\ ~wvalid[r] => sstate # "RUNNING"
(* OmniVersions' NoSilentRevert along the replay: after a restart under a version floor the
   stage serves nothing below it (an update at or above it, or a restart that resets it). *)
W_NoServingBelowFloor == sstate = "RUNNING" => sver >= sfloor
===================================================================================
