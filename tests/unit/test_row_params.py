"""A run row's write names its values by :data:`flowloop.store.appends.ROW_PARAMS`,
position by position: ``stored_columns`` must give them in ``RECORD_COLUMNS``' order."""

from __future__ import annotations

from flowloop import journal as j
from flowloop.store.appends import RECORD_COLUMNS, ROW_PARAMS, stored_columns


def test_stored_columns_come_in_the_order_of_the_row_parameters() -> None:
    record = j.create(
        j.new_event(
            {
                "run_id": "r",
                "seq": 1,
                "kind": j.RUN_CREATED,
                "at": 1.0,
                "state": "s",
                "context": "{}",
                "data": {"workflow": "w", "version": 1, "fingerprint": "f", "key": None},
            }
        )
    )
    columns = stored_columns(record)
    assert tuple(columns) == RECORD_COLUMNS
    assert tuple(f"p_{name}" for name in RECORD_COLUMNS) == ROW_PARAMS
    assert dict(zip(ROW_PARAMS, columns.values(), strict=True)) == {
        f"p_{name}": value for name, value in columns.items()
    }
