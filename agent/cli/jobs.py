"""``jetson-agent jobs ls`` / ``jetson-agent jobs show ID``: jobs in the daemon's journal."""

import argparse
import json
from typing import Any

from agent.cli.status import add_state_args, open_journal, when
from agent.errors import AgentError
from agent.wire import protocol


def add_parser(sub: Any) -> None:
    p = sub.add_parser("jobs", help="jobs the device daemon received", description=__doc__)
    jsub = p.add_subparsers(dest="jobs_command", metavar="ls|show")
    ls = jsub.add_parser("ls", help="list jobs, oldest first")
    add_state_args(ls)
    ls.add_argument("--state", action="append", choices=protocol.STATES,
                    help="only jobs in this state (repeatable)")
    ls.add_argument("--limit", type=int, help="at most this many (the newest)")
    ls.add_argument("--json", action="store_true")
    ls.set_defaults(func=run_ls)
    show = jsub.add_parser("show", help="one job: document, state, result, error")
    add_state_args(show)
    show.add_argument("job_id", metavar="ID")
    show.add_argument("--json", action="store_true")
    show.set_defaults(func=run_show)
    p.set_defaults(func=lambda args: p.print_help() or 2)


def run_ls(args: argparse.Namespace) -> int:
    with open_journal(args) as journal:
        rows = journal.jobs(args.state)
    if args.limit is not None:
        rows = rows[-args.limit:] if args.limit > 0 else []
    if args.json:
        print(json.dumps([{k: r[k] for k in ("job_id", "kind", "state", "version", "stage",
                                               "progress", "received", "updated", "attempts",
                                               "error")} for r in rows], indent=2))
        return 0
    if not rows:
        print("no jobs")
        return 0
    print("{:<24} {:<7} {:<11} {:>4} {:<19} {}".format("JOB", "KIND", "STATE", "VER", "UPDATED",
                                                      "STAGE / ERROR"))
    for r in rows:
        extra = r["stage"] or ""
        if r["error"]:
            extra = "{}: {}".format(r["error"].get("code"), r["error"].get("message", ""))[:60]
        print("{:<24} {:<7} {:<11} {:>4} {:<19} {}".format(
            r["job_id"], r["kind"] or "?", r["state"], r["version"], when(r["updated"]), extra))
    return 0


def run_show(args: argparse.Namespace) -> int:
    with open_journal(args) as journal:
        row = journal.job(args.job_id)
    if row is None:
        raise AgentError("unknown_job", "no job {!r} in the journal".format(args.job_id))
    if args.json:
        print(json.dumps(row, indent=2, sort_keys=True))
        return 0
    print("job {} ({}) {} version {}".format(row["job_id"], row["kind"], row["state"],
                                             row["version"]))
    print("received {}, updated {}, attempts {}".format(when(row["received"]),
                                                        when(row["updated"]), row["attempts"]))
    if row["stage"]:
        print("stage {}{}".format(row["stage"], " {}/{}".format(
            row["progress"]["done"], row["progress"]["of"]) if row["progress"] else ""))
    if row["details"]:
        print("details: " + ", ".join("{}={}".format(k, v)
                                      for k, v in sorted(row["details"].items())))
    if row["error"]:
        print("error [{}]: {}".format(row["error"].get("code"), row["error"].get("message")))
    if row["result"] is not None:
        print("result:")
        print(json.dumps(row["result"], indent=2, sort_keys=True))
    if row["doc"] is not None:
        print("document:")
        print(json.dumps(row["doc"], indent=2, sort_keys=True))
    return 0
