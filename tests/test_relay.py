"""The pipeline's relay of `dvc repro`'s output (agentkiln.relay): progress bars thinned, stamps not doubled."""

from agentkiln.relay import Relay


def test_a_bar_shows_its_first_and_last_line_and_one_per_interval():
    now = [0.0]
    out: list[str] = []
    relay = Relay(out.append, every_s=30.0, clock=lambda: now[0])
    for i in range(0, 101):  # one refresh every second
        now[0] = float(i)
        relay(f"sft epoch 1/16: {i:3d}%|#         | {i}/100 [00:{i:02d}<00:10, 9.9it/s, loss=1.0]")
    shown = [int(line.split(":")[1].split("%")[0]) for line in out]
    assert shown == [0, 30, 60, 90, 100]
    relay("sft epoch 2/16:   0%|          | 0/100")  # the next bar starts fresh
    assert out[-1].startswith("sft epoch 2/16:   0%")


def test_the_childs_timestamp_and_blank_lines_are_dropped_but_warnings_keep_their_level():
    out: list[str] = []
    relay = Relay(out.append)
    relay("07:40:50.861 | INFO    | Flow run 'impartial-sunfish' - Beginning subflow run")
    relay("")
    relay("   ")
    relay("07:40:51.000 | WARNING | Flow run 'x' - careful")
    relay("Running stage 'sft':")
    assert out == ["Flow run 'impartial-sunfish' - Beginning subflow run", "WARNING | Flow run 'x' - careful",
                   "Running stage 'sft':"]
