"""The texts of ``kvserve bench spec``'s workloads: original prose, code and facts.

Three of them ask the model to copy from its prompt (where a speculative
proposal that looks the continuation up in the context is often right); the
fourth asks for free writing, with nothing to copy.
"""

from __future__ import annotations

# About 60 lines; ``bucket`` appears throughout, so the rename touches most lines
# while the rest of the function must come back unchanged.
CODE_FUNCTION = '''\
def summarize_shipments(shipments, cutoff_day, currency_rates):
    """Group shipments by warehouse and return per-warehouse totals.

    Shipments dated after cutoff_day are skipped. Amounts are converted to
    euros with currency_rates, a mapping from currency code to rate.
    """
    summary = {}
    skipped = 0
    for shipment in shipments:
        if shipment["day"] > cutoff_day:
            skipped += 1
            continue
        warehouse = shipment["warehouse"].strip().lower()
        bucket = summary.get(warehouse)
        if bucket is None:
            bucket = {
                "count": 0,
                "weight_kg": 0.0,
                "value_eur": 0.0,
                "late": 0,
                "carriers": set(),
                "heaviest": None,
            }
            summary[warehouse] = bucket
        rate = currency_rates.get(shipment["currency"])
        if rate is None:
            raise ValueError(
                f"no rate for currency {shipment['currency']!r} "
                f"in shipment {shipment['id']}"
            )
        bucket["count"] += 1
        bucket["weight_kg"] += shipment["weight_kg"]
        bucket["value_eur"] += shipment["value"] * rate
        bucket["carriers"].add(shipment["carrier"])
        if shipment["delivered_day"] - shipment["day"] > shipment["promised_days"]:
            bucket["late"] += 1
        heaviest = bucket["heaviest"]
        if heaviest is None or shipment["weight_kg"] > heaviest["weight_kg"]:
            bucket["heaviest"] = shipment
    report = []
    for warehouse in sorted(summary):
        bucket = summary[warehouse]
        average_weight = bucket["weight_kg"] / bucket["count"]
        late_share = bucket["late"] / bucket["count"]
        report.append(
            {
                "warehouse": warehouse,
                "shipments": bucket["count"],
                "average_weight_kg": round(average_weight, 2),
                "value_eur": round(bucket["value_eur"], 2),
                "late_share": round(late_share, 3),
                "carriers": sorted(bucket["carriers"]),
                "heaviest_id": bucket["heaviest"]["id"],
            }
        )
    return report, skipped
'''

CODE_EDIT_REQUEST = (
    "Rewrite this function with the variable `bucket` renamed to `totals`. "
    "Change nothing else. Output the whole function.\n\n```python\n" + CODE_FUNCTION + "```"
)

# About 1,000 tokens of an invented town's report on its water supply.
DOCUMENT = """\
Annual Report of the Harrowmere Water Board

The Harrowmere Water Board supplies drinking water to the town of Harrowmere and to the four \
farming hamlets along the Little Tessel valley. This report covers the twelve months that ended \
on the last day of September, and it was approved by the board at its autumn meeting.

Sources and storage. Most of the town's water comes from the Brackenfold reservoir, an upland \
lake held back by an earth dam built in the last years of the nineteenth century. The reservoir \
holds about four hundred million litres when full. A smaller share comes from two boreholes on \
the edge of Ashby Common, which draw on a sandstone aquifer about sixty metres below the surface. \
In late summer, when the reservoir is low and its water is warmer and harder to treat, the \
boreholes supply most of the town. During the year the boreholes provided just under a fifth of \
all the water the board supplied.

The level of the reservoir is read every morning at seven o'clock from a staff gauge fixed to the \
valve tower, and the reading is confirmed each week by a pressure sensor on the floor of the \
lake. When the two readings differ by more than five centimetres, the sensor is recalibrated \
before the next weekly check. The lowest level of the year was recorded on the nineteenth of \
August, when the reservoir stood at forty-one per cent of its capacity.

Treatment. Water from both sources passes through the treatment works at Millford Bridge. It is \
first screened and then mixed with a coagulant that gathers fine particles into clumps heavy \
enough to settle. After settling, the water runs through rapid sand filters and then through \
slow sand filters, whose top layer of living organisms removes much of what the first stage \
leaves behind. Finally the water is disinfected with a small, carefully measured dose of \
chlorine before it enters the service reservoirs on Gallows Hill. The slow sand filters were \
cleaned twice during the year, in March and in October, and each cleaning took one filter out of \
service for about three weeks.

Quality. The board took two thousand three hundred and twelve samples during the year, at the \
works, at the service reservoirs and at taps in homes, schools and businesses chosen at random. \
Every sample was tested for bacteria, and a rotating selection was tested for metals, nitrates \
and the by-products of disinfection. Two samples taken in June from a tap at the Orchard Lane \
primary school showed traces of lead above the permitted limit. The school's old lead pipe was \
replaced within three weeks, and all later samples from the school were within the limit. No \
other sample failed any test.

Leaks and repairs. The network has two hundred and six kilometres of mains, about a third of \
which were laid before 1950. The board estimates that eleven per cent of the water leaving the \
works is lost to leaks before it reaches a customer, down from fourteen per cent three years \
ago. Crews repaired three hundred and forty leaks during the year, most of them small. The \
largest was a burst main under Station Road in January, which closed the road for two days and \
left about nine hundred homes without water for most of one afternoon. Acoustic loggers, which \
listen for the hiss of escaping water at night, were fitted to a further eighteen kilometres of \
mains, and they found sixty-two of the year's leaks before any water reached the surface.

Customers and charges. The board serves eleven thousand four hundred households and about six \
hundred businesses. Average use was one hundred and thirty-eight litres per person per day, \
three litres less than the year before. The standard charge rose by four per cent in April, the \
first rise in two years, to pay for the replacement of old mains. Customers who cannot afford \
their bills may apply to the hardship fund, which helped two hundred and seventy households \
during the year. Complaints fell to one hundred and nine, of which forty concerned low pressure \
on the upper streets of the Crofts estate; a booster pump installed there in May has since \
resolved most of them.

The year ahead. The board plans to replace nine kilometres of the oldest mains, to begin a study \
of a third borehole, and to raise the spillway of the Brackenfold dam by thirty centimetres, \
which would add about six per cent to the reservoir's capacity. The board will also publish the \
results of every tap sample on its website within a week of the test, starting in January.
"""

# The section asked for is the report's first (after a two-sentence opening), so the
# answer is a long run of copied sentences: SmolLM2-135M quotes the opening and the section
# and is still copying at 256 tokens. Asked about a later section, small chat models answer
# in a sentence of their own or a paraphrase, which leaves a speculative proposal nothing
# to copy; and they stop quoting if the request opens with an instruction before the
# report, so the question comes only after it.
DOCUMENT_QUESTION = (
    DOCUMENT + "\nWhat does the report say about the sources and storage of the water? "
    "Quote the whole section word for word."
)

FACTS = (
    "Kestrel Row Bicycles was founded in 2011 by Marguerite Okafor-Lindqvist in a former "
    "tram depot at 14 Quayside Lane, Port Ellery. The company builds steel touring frames by "
    "hand; its best-known model, the Wayfarer Mk III, weighs 2.41 kg as a bare frame and sells "
    "for 1,890 euros. In 2023 the workshop employed 17 people and shipped 1,206 frames, mostly to "
    "customers in Norway, Japan and Chile. Orders are taken by email at orders@kestrelrow.example "
    "and the waiting list is currently 14 weeks. The head frame builder is Teodor Vasquez-Hale, "
    "who joined from a shipyard in 2015."
)

JSON_REQUEST = (
    FACTS
    + "\n\nExtract these fields from the paragraph above as a JSON object, copying each value "
    "as the exact string it appears as in the text: company_name, founder, founding_year, "
    "address, flagship_model, frame_weight, price, employees_2023, frames_shipped_2023, "
    "export_countries (a list), order_email, waiting_list, head_builder. Output only the JSON."
)

CHAT_REQUEST = (
    "Invent a short story about a lighthouse keeper who finds a stray fox on the island one "
    "winter night. Give the fox a personality, describe the weather, and end the story with "
    "the first morning of spring."
)
