"""The chat requests of ``kvpilot bench spec``: a copy-heavy workload and an open-ended one.

Copy-heavy requests ask for output that repeats much of the input: rewrite a passage with
one edit, rename an identifier in a piece of code, extract fields of a document as JSON.
Open-ended requests ask for new text (explanations, stories, advice). Every request is
distinct (its own passage, code or question), so prefix caching does not make one
request's answer another's.
"""

from __future__ import annotations

PASSAGES = (
    "The harbour town woke slowly. Fishing boats came in before dawn, their decks stacked with "
    "crates of silver fish, and the market opened as the first light reached the hills. Traders "
    "argued over prices, children ran between the stalls, and the smell of bread drifted from the "
    "bakery on the corner. By noon the square was quiet again, and the old men played cards in "
    "the shade of the church while the boats were washed and the nets were mended for the night.",
    "Paged attention stores the keys and values of every sequence in fixed-size blocks, and a "
    "block table maps each sequence's logical positions to physical blocks. Because blocks are "
    "allocated on demand, memory is not reserved for tokens that may never be generated, and "
    "sequences that share a prefix can share its blocks. The scheduler admits requests while "
    "free blocks remain and preempts the newest request when the pool runs out, so that the "
    "batch keeps moving and no request waits forever for memory.",
    "The museum's new wing holds the collection of maps donated by the Harding family. The oldest "
    "map, drawn on vellum in the fourteenth century, shows the coast as a row of towers and "
    "rivers as blue ribbons. Later maps add roads, mills and the names of farms, and the last of "
    "them, printed in the nineteenth century, marks the railway that changed the valley. Visitors "
    "can compare the maps side by side and follow how the town grew from a ford into a city.",
    "A good code review starts with the purpose of the change. The reviewer reads the description, "
    "then the tests, and only then the implementation, asking whether the code does what the "
    "description promises and whether the tests would fail if it did not. Small comments about "
    "names and layout come last. A review that finds no problem is not wasted: it spreads "
    "knowledge of the code, and the next change in that area will be easier for both people.",
)

CODE = (
    "def load_records(path):\n    records = []\n    with open(path) as handle:\n        for line in handle:\n"
    "            line = line.strip()\n            if not line or line.startswith('#'):\n                continue\n"
    "            name, value = line.split('=', 1)\n            records.append((name.strip(), value.strip()))\n"
    "    return records\n\n\ndef summarize(records):\n    total = 0\n    for name, value in records:\n"
    "        total += len(value)\n    return {'count': len(records), 'total': total}\n",
    "class Inventory:\n    def __init__(self):\n        self.items = {}\n\n    def add(self, name, count):\n"
    "        self.items[name] = self.items.get(name, 0) + count\n\n    def remove(self, name, count):\n"
    "        if self.items.get(name, 0) < count:\n            raise ValueError(f'not enough {name}')\n"
    "        self.items[name] -= count\n\n    def report(self):\n        for name, count in sorted(self.items.items()):\n"
    "            print(f'{name}: {count}')\n",
)

DOCUMENTS = (
    "INVOICE 2024-117\nFrom: Northwind Supplies Ltd, 14 Mill Lane, Leeds\nTo: Harbour Cafe, 3 Quay Street, "
    "Whitby\nDate: 12 March 2024\nItems: 40 kg coffee beans at 18.50 per kg; 12 boxes of paper cups at 9.20 "
    "per box\nTotal due: 850.40 GBP\nPayment terms: 30 days, bank transfer to account 40-11-27 81234567",
    "ORDER CONFIRMATION\nCustomer: Maria Lopez, maria.lopez@example.com\nOrder number: A-55821\nPlaced: "
    "2 June 2024\nShip to: 88 Rue des Fleurs, Lyon, France\nProducts: one walnut desk (model WD-3), two "
    "oak chairs (model OC-1)\nAmount charged: 1240.00 EUR\nDelivery: between 10 and 14 June by Transalp Freight",
)

QUESTIONS = (
    "Explain in a few paragraphs why the sky is blue.",
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Give me some advice for a first job interview.",
    "What are the pros and cons of working from home?",
    "Describe how a bicycle works to a ten-year-old.",
    "Write a poem about autumn in the city.",
    "How should a beginner start learning to cook?",
    "Tell me about the history of tea.",
)


def copy_heavy(index: int) -> list[dict]:
    """Request ``index`` of the copy-heavy workload (cycling through its kinds)."""
    kind, item = index % 3, index // 3
    if kind == 0:
        text = PASSAGES[item % len(PASSAGES)]
        prompt = ("Rewrite the following passage exactly as it is, word for word, but write "
                  f"every number as digits.\n\n{text}")
    elif kind == 1:
        code = CODE[item % len(CODE)]
        prompt = ("Rewrite this Python code with every variable named `name` renamed to `key`. "
                  f"Output the whole code and nothing else.\n\n{code}")
    else:
        doc = DOCUMENTS[item % len(DOCUMENTS)]
        prompt = ("Extract the sender or customer, the date, the items or products and the total "
                  f"amount from this document as a JSON object, quoting the text exactly.\n\n{doc}")
    return [{"role": "user", "content": f"[{index}] {prompt}"}]


def open_ended(index: int) -> list[dict]:
    """Request ``index`` of the open-ended chat workload."""
    return [{"role": "user", "content": f"[{index}] {QUESTIONS[index % len(QUESTIONS)]}"}]


WORKLOADS = {"copy": copy_heavy, "chat": open_ended}
