"""profiling/bench_scheduler.py runs both modes and refuses a bad count."""

from profiling import bench_scheduler


def test_prints_both_modes(capsys):
    assert bench_scheduler.main(["--rows", "4", "--steps", "20", "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    assert "prefix cache off" in out and "prefix cache on" in out
    assert bench_scheduler.step_us(True, 4, 20) > 0
    assert bench_scheduler.main(["--rows", "0"]) == 2
