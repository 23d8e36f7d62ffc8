"""The planner's calibration in a world of one (a real process group of one rank); the
planner's pure logic is tests/unit/test_plan.py."""


def test_calibration_takes_the_median_of_per_step_maxima():
    """[Note: slowest rank per step]: one rank here, so the maxima are the times themselves."""
    import dataparallel as dp
    from dataparallel.plan.calibrate import slowest_medians

    dp.init()
    try:
        assert slowest_medians([0.3, 0.1, 0.2], [4.0, 2.0, 9.0]) == [0.2, 4.0]
    finally:
        dp.destroy()
