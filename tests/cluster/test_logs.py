"""Log lines are one line each, whatever a field's value holds (a client's id, an error)."""

import logging

from kvmesh.cli.logs import KeyValueFormatter


def test_log_values_cannot_end_the_line_or_forge_a_field():
    record = logging.makeLogRecord({"msg": "request failed", "levelname": "WARNING", "name": "t"})
    record.request_id = "abc\n12:00:00 error kvmesh forged=1"
    line = KeyValueFormatter().format(record)
    assert "\n" not in line and line.endswith('request_id="abc\\n12:00:00 error kvmesh forged=1"')
