"""The partitioner's account of itself: explain()'s report and the collectives counted in compiled HLO.

Holds report.py (rows, totals, text, JSON, HTML) and hlo.py (collectives by kind, with the cost model's byte
accounting). May import representation/, rules/, costs/, strategies/ and propagation/."""
