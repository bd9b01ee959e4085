"""The ``msrl`` command: ``train``, ``config``, ``graph``, ``eval``, ``plot``, ``bench``."""

from __future__ import annotations

import argparse
import functools
import json
import os
import re
import sys
from pathlib import Path
from typing import Any

from msrl.errors import CALLBACK_LOGS, CLI_FLAGS, ConfigError, Interrupted, MsrlError


def _graph_text(program: Any) -> str:
    g = program.fdg
    lines = ["fragments:"]
    for f in program.fragments.values():
        where = (f" devices={','.join(map(str, f.spec.devices))}" if f.spec.devices is not None else "") + \
            (f" num_cpus={f.spec.num_cpus:g} num_gpus={f.spec.num_gpus:g}" if f.spec.backend == "ray" else "")
        lines.append(f"  {f.name}: replicas={f.spec.replicas} backend={f.spec.backend}{where} jit={f.spec.jit} "
                     f"state={','.join(f.state_keys)}")
    lines.append(f"env steps per iteration: {program.env_steps_per_iteration}")
    lines += [f"beside the graph: {line}" for line in program.beside_the_graph()]
    lines.append("nodes (program order; shapes are the whole program's, all replicas of a fragment together):")

    def depth(n: str) -> int:
        d, p = 0, g.nodes[n].get("parent")
        while p is not None:
            d, p = d + 1, g.nodes[p].get("parent")
        return d

    order = list(g.nodes)
    for n in order:
        d = g.nodes[n]
        ind = "  " * (depth(n) + 1)
        if d["kind"] == "loop":
            head = f"loop x{d['trip_count']}"
        elif d["kind"] == "api":
            head = d["api"]
        elif d["kind"] == "comm":
            head = f"COMM {d['op']}"
        else:
            head = d["kind"]
        where = f"  ({Path(d['file']).name}:{d['line']})" if d.get("file") else ""
        lines.append(f"{ind}{n} [{d.get('fragment')}] {head}: {d.get('text', '')}{where}")
        for u, _, e in g.in_edges(n, data=True):
            shape = f" {e['dtype']}{e['shape']}" if e["shape"] is not None else ""
            carry = " (carried)" if e["carry"] else ""
            lines.append(f"{ind}    <- {u} {e['kind']} {e['name']}{shape}{carry}")
    return "\n".join(lines)


def _graph_dot(program: Any) -> str:
    g = program.fdg
    colors = ["#cfe2ff", "#d1e7dd", "#fff3cd", "#f8d7da", "#e2d9f3", "#cff4fc"]
    frag_color = {f: colors[i % len(colors)] for i, f in enumerate(program.fragments)}
    out = ["digraph fdg {", "  rankdir=TB; node [shape=box, style=filled, fontname=monospace];"]

    def node_line(n: str, indent: str) -> str:
        d = g.nodes[n]
        label = d["api"] if d["kind"] == "api" else (f"{d['op']}\\n{d['text']}" if d["kind"] == "comm"
                                                      else d.get("text", d["kind"]))
        label = label.replace('"', '\\"')
        shape = "ellipse" if d["kind"] == "comm" else "box"
        color = frag_color.get(d.get("fragment"), "#eeeeee")
        return f'{indent}"{n}" [label="{n}: {label}", shape={shape}, fillcolor="{color}"];'

    def emit(parent: str | None, indent: str) -> None:
        for n, d in g.nodes(data=True):
            if d.get("parent") != parent:
                continue
            if d["kind"] == "loop":
                out.append(f'{indent}subgraph "cluster_{n}" {{ label="{n}: loop x{d["trip_count"]}";')
                emit(n, indent + "  ")
                out.append(f"{indent}}}")
            else:
                out.append(node_line(n, indent))

    emit(None, "  ")
    for u, v, e in g.edges(data=True):
        if g.nodes[u]["kind"] == "loop" or g.nodes[v]["kind"] == "loop":
            continue
        style = "dashed" if e["carry"] else "bold" if e["kind"] == "params" else "solid"  # (dashed: carried, as
        color = ', color="gray40"' if e["kind"] == "state" else ""  # in the image; a component's state: grey)
        shape = f"\\n{e['dtype']}{e['shape']}" if e["shape"] is not None and e["kind"] == "data" else ""
        label = (e["name"] + shape).replace('"', '\\"')
        out.append(f'  "{u}" -> "{v}" [label="{label}", style={style}{color}'
                   f'{", constraint=false" if e["carry"] else ""}];')
    out.append("}")
    return "\n".join(out)


def _graph_png(program: Any, path: str) -> None:
    """The FDG as an image: nodes layered by the loop's order, coloured by fragment (communication nodes grey),
    loop-carried edges (a value used by the next iteration) dashed; a component's state carried to itself is
    left out."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import networkx as nx
    from matplotlib.patches import Patch

    g = nx.MultiDiGraph()
    for n, d in program.fdg.nodes(data=True):
        if d["kind"] != "loop":
            g.add_node(n, **d)
    edges = [(u, v, d["carry"]) for u, v, d in program.fdg.edges(data=True) if u in g and v in g and u != v]
    forward = nx.DiGraph([(u, v) for u, v, carry in edges if not carry])
    forward.add_nodes_from(g)
    layers = {n: i for i, gen in enumerate(nx.topological_generations(forward)) for n in gen}
    nx.set_node_attributes(forward, layers, "layer")
    pos = {n: (x, -y) for n, (x, y) in nx.multipartite_layout(forward, subset_key="layer", align="horizontal").items()}
    cmap = plt.get_cmap("Pastel1")
    frag_color = {f: cmap(i % 9) for i, f in enumerate(program.fragments)}
    comm = [n for n, d in g.nodes(data=True) if d["kind"] == "comm"]
    labels = {n: f"{n}\n{d.get('api') or d.get('op') or d['kind']}" for n, d in g.nodes(data=True)}
    fig, ax = plt.subplots(figsize=(8, 1.2 * (max(layers.values(), default=0) + 2)))
    for nodes, color, shape in ((comm, "#dddddd", "o"), ([n for n in g if n not in comm], None, "s")):
        colors = color or [frag_color.get(g.nodes[n].get("fragment"), "#eeeeee") for n in nodes]
        nx.draw_networkx_nodes(g, pos, nodelist=nodes, node_color=colors, node_shape=shape, node_size=2200, ax=ax)
    nx.draw_networkx_labels(g, pos, labels=labels, font_size=7, ax=ax)
    for carried, style in ((False, "solid"), (True, "dashed")):
        nx.draw_networkx_edges(g, pos, edgelist=sorted({(u, v) for u, v, c in edges if c == carried}), ax=ax,
                               style=style, node_size=2200, arrows=True,
                               connectionstyle="arc3,rad=0.3" if carried else "arc3")
    ax.legend(handles=[*(Patch(color=c, label=f"fragment {f}") for f, c in frag_color.items()),
                       *([Patch(color="#dddddd", label="communication")] if comm else []),
                       plt.Line2D([], [], color="k", linestyle="--", label="carried to the next iteration")],
              loc="upper left", bbox_to_anchor=(1, 1), fontsize=7)
    ax.set_title(f"FDG of {type(program.algorithm).__name__} under policy {program.policy.name}")
    ax.axis("off")
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)


def _config_and_overrides(args: argparse.Namespace) -> tuple[str | None, list[str]]:
    """The config file and the overrides, where the file may be left out (``msrl config algorithm.name=sac``,
    ``msrl train --resume DIR KEY=VALUE``): a first argument that is a KEY=VALUE, not a file, is an override."""
    config, overrides = args.config, list(args.overrides)
    if config is not None and "=" in config and not Path(config).exists():
        return None, [config, *overrides]
    return config, overrides


def cmd_train(args: argparse.Namespace) -> int:
    from msrl.runner import summary_json, train

    if args.resume and args.run_dir and Path(args.run_dir).resolve() != Path(args.resume).resolve():
        raise ConfigError("--resume", "a resumed run continues in its own directory; drop --run-dir")
    if args.resume and args.overwrite:
        raise ConfigError("--overwrite", "a resumed run continues its directory; --overwrite would clear it")
    if args.overwrite and not args.run_dir:
        raise ConfigError("--overwrite", "replaces the run in --run-dir DIR; without --run-dir each run gets a fresh "
                          "directory")
    config, overrides = _config_and_overrides(args)
    if config is None and not args.resume:
        if not any(o.partition("=")[0].strip() in ("algorithm.name", "algorithm") for o in overrides):
            raise ConfigError("config", "msrl train needs a config file (or KEY=VALUE overrides naming "
                              "algorithm.name, or --resume RUN_DIR, which reads the run's own)" +
                              (": it goes before the KEY=VALUE overrides" if any("=" not in o for o in overrides)
                               else ""))
        config = {}  # (`msrl train algorithm.name=sac`: every other key at its default, as msrl config prints)
    summary = train(config, overrides, run_dir=args.resume or args.run_dir, resume=bool(args.resume),
                    overwrite=args.overwrite)
    print(summary_json(summary))
    return 0


def cmd_config(args: argparse.Namespace) -> int:
    from msrl.config import commented, load_config

    text = commented(load_config(*_config_and_overrides(args)))
    if args.output:
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output).write_text(text, encoding="utf-8")
        print(f"wrote {args.output}")
    else:
        print(text, end="")
    return 0


def cmd_graph(args: argparse.Namespace) -> int:
    from msrl.config import in_file, load_config
    from msrl.plot import check_image_file
    from msrl.runner import build
    from msrl.runtime.session import check_members

    suffixes = {".png": "png", ".svg": "png", ".pdf": "png", ".json": "json", ".dot": "dot", ".gv": "dot"}
    suffix = Path(args.output).suffix.lower() if args.output else ""
    implied = suffixes.get(suffix)
    if implied is None and suffix not in ("", ".txt"):  # another image format matplotlib writes (.jpg, .eps, ...)
        from matplotlib.backend_bases import FigureCanvasBase

        implied = "png" if suffix[1:] in FigureCanvasBase.get_supported_filetypes() else None
    if args.format is None:
        args.format = implied or "text"
    elif implied not in (None, args.format):
        kind = "an image" if implied == "png" else f"a {implied} file"
        raise ConfigError("--format", f"-o {args.output} names {kind}, not {args.format}: drop --format (the suffix "
                          f"picks it), or give -o another name")
    if args.format == "png":
        if not args.output:
            raise MsrlError("--format png needs -o FILE.png")
        if args.code:
            raise ConfigError("--code", "adds the generated code to text, JSON or DOT output, not to an image: drop "
                              "--code, or write -o FILE.dot (or .json, .txt)")
        check_image_file(args.output)
    config, overrides = _config_and_overrides(args)
    if config is None and not overrides:
        raise ConfigError("config", "msrl graph needs a config file (or KEY=VALUE overrides naming algorithm.name)")
    if args.policy:
        other = [o for o in overrides if o.startswith("policy.name=") and o != f"policy.name={args.policy}"]
        if other:
            raise ConfigError("--policy", f"--policy {args.policy} and {other[0]} name different policies; give one")
        overrides.append(f"policy.name={args.policy}")
    cfg = load_config(config, overrides)
    check_members(cfg.policy.backend, cfg.run, cfg.env.id)  # what train refuses (seeds or a sweep where it cannot)
    try:
        program = build(cfg)
    except ConfigError as e:  # (the env's, the algorithm's checks: where the file writes the key)
        raise in_file(e, config, overrides) from None
    if args.output:
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    if args.format == "png":
        _graph_png(program, args.output)
        print(f"wrote {args.output}")
        return 0
    text = {"text": _graph_text, "json": lambda p: p.to_json(), "dot": _graph_dot}[args.format](program)
    if args.code and args.format == "json":
        text = json.dumps({**json.loads(text), "code": {f.name: f.source for f in program.fragments.values()}},
                          indent=2, default=str)
    elif args.code:  # (in DOT as comments, so the file stays a graph)
        code = program.code()
        text += "\n\n" + ("\n".join(f"// {line}" for line in code.splitlines()) if args.format == "dot" else code)
    if args.output:
        Path(args.output).write_text(text + "\n")
        print(f"wrote {args.output}")
    else:
        print(text)
    return 0


def _json_file(path: str | None) -> None:
    """``--json FILE`` checked before the work whose figures it takes (a folder there, or a file that cannot be
    written, was an error after it)."""
    if not path:
        return
    if Path(path).is_dir():
        raise ConfigError("--json", f"{path} is a folder; give the name of a file to write")
    try:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        existed = Path(path).exists()
        with open(path, "a"):
            pass
        if not existed:
            Path(path).unlink()
    except OSError as e:
        raise ConfigError("--json", f"cannot write {path}: {e.strerror or e}") from None


def _write_json(path: str | None, data: Any) -> None:
    """``--json FILE``: ``data`` written to FILE (where given; its folder made, as -o's are), and a line saying so."""
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        from msrl.runner import summary_json  # (strict JSON: a NaN result is null, not a bare NaN)

        Path(path).write_text(summary_json(data) + "\n")
        print(f"wrote {path}")


def _scored(out: dict) -> str:
    """One ``msrl eval`` line: the return over the episodes, and what was evaluated."""
    which = f", {out['member']}" if "member" in out else f", seed {out['run_seed']}" if "run_seed" in out else ""
    episodes = f"{out['episodes']} episode{'s' * (out['episodes'] != 1)}"
    mean = out["return_mean"] if round(out["return_mean"], 2) != 0 else 0.0  # (-0.0049: "-0.00")
    return (f"return {mean:.2f} ± {out['return_std']:.2f} over {episodes} of "
            f"{out['length_mean']:,.1f} steps on average, {out['env_steps']:,} env steps (greedy; {out['checkpoint']}, "
            f"iteration {out['iteration']}{which})")


def cmd_eval(args: argparse.Namespace) -> int:
    import statistics

    from msrl.evaluate import evaluate, evaluate_each

    _json_file(args.json)
    if args.all:
        for flag in ("run_seed", "member", "render"):
            if getattr(args, flag) is not None:
                raise ConfigError(f"--{flag.replace('_', '-')}", "evaluates one member; --all evaluates each")
        each = evaluate_each(args.run_dir, episodes=args.episodes, seed=args.seed)
        groups: dict[str, list[dict]] = {}  # a swept value's seeds (or the seeds of a run without a sweep)
        for out in each:
            print(_scored(out))
            groups.setdefault(re.sub(r",?seed_\d+$", "", out["member"]), []).append(out)
        over_seeds = {}
        for value, outs in groups.items():
            if len(outs) > 1:
                means = [o["return_mean"] for o in outs]
                mean, std = statistics.fmean(means), statistics.pstdev(means)
                over_seeds[value or "the run"] = {"return_mean": mean, "return_std": std, "seeds": len(outs)}
                print(f"{value or 'the run'}: mean return {mean:.2f} ± {std:.2f} over its {len(outs)} seeds (the std "
                      "is that of the seeds' means)")
        _write_json(args.json, {"members": each, "over_seeds": over_seeds})
        return 0
    out = evaluate(args.run_dir, episodes=args.episodes, render=args.render, seed=args.seed, run_seed=args.run_seed,
                   member=args.member)
    print(_scored(out))
    if args.render:
        print(f"wrote {out['frames']} frames and episode.gif to {args.render} (the first episode: return "
              f"{out['render_return']:.2f})")
    _write_json(args.json, out)
    return 0


def cmd_plot(args: argparse.Namespace) -> int:
    from msrl.plot import plot_runs

    print(f"wrote {plot_runs(args.run_dirs, args.output, args.smooth, args.aggregate, args.metric)}")
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from rich.console import Console

    from msrl.bench import run_benchmarks, table

    _json_file(args.json)
    console = Console()
    records = run_benchmarks(directory=args.dir, quick=not args.full, only=args.only, console=console)
    console.print(table(records))
    _write_json(args.json, {"mode": "full" if args.full else "quick", "benchmarks": records})
    return 1 if any(r["status"] == "failed" for r in records) else 0  # (skipped: a peer not installed)


def make_parser() -> argparse.ArgumentParser:
    from msrl import __version__

    p = argparse.ArgumentParser(prog="msrl", description="Write an RL algorithm once; run it under any policy.")
    p.add_argument("--version", action="version", version=f"msrl {__version__}")
    sub = p.add_subparsers(dest="command", required=True)
    sub.add_parser = functools.partial(sub.add_parser, allow_abbrev=False)  # (--run was --run-dir, or --run-seed)

    t = sub.add_parser("train", help="train from a YAML config with KEY=VALUE overrides")
    t.add_argument("config", nargs="?", help="YAML config (optional with --resume: the run's own; or none: "
                   "`msrl train algorithm.name=ppo` trains on the algorithm's defaults)")
    t.add_argument("overrides", nargs="*", help="e.g. run.seed=1 policy.name=fused")
    t.add_argument("--run-dir", default=None, help="where metrics, config and summary go (default: a new "
                   "runs/ALGORITHM-POLICY-TIME); a directory that holds a run is refused")
    t.add_argument("--resume", metavar="RUN_DIR", default=None, help="continue RUN_DIR from its latest checkpoint")
    t.add_argument("--overwrite", action="store_true",
                   help="replace the run in --run-dir (cleared once the new run has compiled and started)")
    t.set_defaults(fn=cmd_train)

    c = sub.add_parser("config", help="print the whole config, every key with its meaning, bounds and default, "
                       "as YAML (a config file of its own)")
    c.add_argument("config", nargs="?", help="YAML config (or none: KEY=VALUE overrides naming algorithm.name)")
    c.add_argument("overrides", nargs="*", help="e.g. algorithm.name=sac policy.name=replay_server")
    c.add_argument("-o", "--output", default=None, help="write it to this file")
    c.set_defaults(fn=cmd_config)

    g = sub.add_parser("graph", help="show the fragmented dataflow graph after partition")
    g.add_argument("config", nargs="?", help="YAML config (or none: KEY=VALUE overrides naming algorithm.name)")
    g.add_argument("overrides", nargs="*", help="e.g. policy.name=single_learner_coarse policy.actors=4")
    g.add_argument("--policy", default=None, help="shorthand for policy.name=P (replaces the config file's policy)")
    g.add_argument("--format", choices=["text", "json", "dot", "png"], default=None,
                   help="default: what -o's suffix names (an image's: .png, .svg, .pdf, ...; .json; .dot/.gv), "
                   "else text")
    g.add_argument("--code", action="store_true", help="also print each fragment's generated source")
    g.add_argument("-o", "--output", default=None, help="write it to this file (default: print it)")
    g.set_defaults(fn=cmd_graph)

    e = sub.add_parser("eval", help="evaluate a run's newest good checkpoint (or the one given) greedily over "
                       "fresh episodes")
    e.add_argument("run_dir", metavar="RUN_DIR", help="a run directory (its newest good checkpoint), a member's "
                   "folder in one (a sweep's RUN_DIR/lr=0.001), or a checkpoint file "
                   "(RUN_DIR/checkpoints/ckpt_*.msgpack)")
    e.add_argument("--episodes", type=int, default=10, help="environments played to the end of their first episode "
                   "(default 10; at most 100,000)")
    e.add_argument("--seed", type=int, default=0, help="the evaluation episodes' seed (default 0)")
    e.add_argument("--run-seed", type=int, default=None, metavar="N",
                   help="a run of several seeds (run.num_seeds): evaluate seed N's policy (default: the first)")
    e.add_argument("--member", metavar="NAME", default=None,
                   help="a run of several seeds or swept values: evaluate the member NAME (its folder's name, e.g. "
                   "lr=0.001,seed_1) of RUN_DIR or of the checkpoint file given")
    e.add_argument("--render", metavar="DIR", default=None, help="write the first episode's frames (PNG) and a GIF here")
    e.add_argument("--all", action="store_true", help="a run of several seeds or swept values: evaluate each member, "
                   "and each swept value's mean over its seeds")
    e.add_argument("--json", metavar="FILE", default=None, help="also write the figures to FILE as JSON")
    e.set_defaults(fn=cmd_eval)
    for command in (t, c, g, e):
        command.add_argument("--import", dest="imports", action="append", metavar="MODULE_OR_FILE",
                             help="import your own algorithm/policy/env module first (repeatable)")
        command.add_argument("--debug", action="store_true", help="on an error, print its full chained traceback")

    pl = sub.add_parser("plot", help="learning curves of run directories (return, or another metric, vs env steps "
                        "and wall time)")
    pl.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="run directories (their metrics.csv)")
    pl.add_argument("-o", "--output", default="curves.png", help="image file (default curves.png)")
    pl.add_argument("--smooth", type=int, default=1, metavar="K", help="moving average over K rows (default 1: none)")
    pl.add_argument("--metric", default="episode_return", metavar="COLUMN",
                    help="the column of metrics.csv to draw (default episode_return; e.g. loss, entropy, sps)")
    pl.add_argument("--aggregate", action="store_true",
                    help="one line per config (runs that differ only in run.*, e.g. seeds): mean ± std")
    pl.set_defaults(fn=cmd_plot)

    b = sub.add_parser("bench", help="run benchmarks/ (msrl vs peers) and print a table")
    mode = b.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="short runs for a rough check, minutes each (default)")
    mode.add_argument("--full", action="store_true", help="the scripts' own defaults (the README's figures)")
    b.add_argument("--only", nargs="+", action="extend", metavar="NAME",
                   help="ppo_fused, ppo_host_threads, sac_vs_sb3 or ppo_ray_vs_rllib (other scripts of benchmarks/ "
                   "run as python benchmarks/NAME.py)")
    b.add_argument("--json", default=None, metavar="FILE", help="also write the combined results as JSON")
    b.add_argument("--dir", default=None, help="benchmarks directory (default: the source checkout's)")
    b.set_defaults(fn=cmd_bench)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = make_parser()
    args, extra = parser.parse_known_args(argv)  # KEY=VALUE overrides may follow options too
    bad = [a for a in extra if "=" not in a or a.startswith("-") or not hasattr(args, "overrides")]
    if bad:  # (said with the top-level usage, and no hint for a misspelt flag)
        from msrl.errors import did_you_mean

        command = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[args.command]
        flags = [o for a in command._actions for o in a.option_strings]
        hint = " ".join(did_you_mean(b.split("=")[0], flags) for b in bad if b.startswith("--")).strip()
        command.error(f"unrecognized arguments: {' '.join(bad)}" + (f"; {hint}" if hint else ""))
    if hasattr(args, "overrides"):
        args.overrides = list(args.overrides) + extra
    if not getattr(args, "debug", False):  # jax logs a raising callback's traceback; the error says it in one line
        import logging

        for name in CALLBACK_LOGS:  # (ray's replicas take the levels set here)
            logging.getLogger(name).setLevel(logging.CRITICAL)
    flags = CLI_FLAGS.set(True)  # errors name the flags, not train()'s keywords
    try:
        from msrl.registry import import_user_module

        for module in getattr(args, "imports", None) or []:
            import_user_module(module)
        return args.fn(args)
    except Interrupted as e:  # (a resume imports what the run's config lists: run.imports)
        print(f"msrl: {e}", file=sys.stderr)
        return 130
    except BrokenPipeError:  # whoever read stdout stopped (`msrl graph ... | head`): nothing to report
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # (else the flush at exit fails again)
        return 1
    except (MsrlError, OSError) as e:  # (OSError: a path given cannot be read or written)
        if getattr(args, "debug", False):
            import traceback

            traceback.print_exception(e, file=sys.stderr)
        print(f"msrl: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("msrl: interrupted", file=sys.stderr)
        return 130
    finally:
        CLI_FLAGS.reset(flags)


if __name__ == "__main__":
    sys.exit(main())
