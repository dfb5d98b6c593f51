"""A command started as from a terminal: its own process group, which a test then sends Ctrl-C (SIGINT) as a terminal
does, with SIGINT's default disposition even when the tests themselves run in the background (`make test &`: a
non-interactive shell starts background jobs with SIGINT ignored, and an ignored signal is inherited across exec)."""
import signal, subprocess


def _default_sigint(): signal.signal(signal.SIGINT, signal.SIG_DFL)


def terminal_popen(args, **kwargs) -> subprocess.Popen:
    "subprocess.Popen(args, **kwargs) in a new session, SIGINT at its default (so Python turns it into Ctrl-C)."
    return subprocess.Popen(args, start_new_session=True, preexec_fn=_default_sigint, **kwargs)
