"""The travel domain of the synthetic corpus: a trip's booking reference, its flight and departure
time, the hotel, the seat, and the fare's checked-bag weight limit a yes/no query needs.

draw_domain(rng, pair) returns what generate_dialogue (srt/data/synthetic.py) lays out: the
comment above srt/data/synthetic_common.Round says what each part is.
"""

from __future__ import annotations

from srt.data.synthetic_common import (
    CITIES,
    MONTHS,
    QueryRound,
    QuerySpec,
    Round,
    SelfContained,
    _clock,
    _kg,
    _other_time,
    _pick,
    _self_contained,
)

FLIGHT_SLOTS = range(6 * 60, 22 * 60, 5)  # departure times
HOTELS = [
    "Grand Harbor Hotel",
    "Maple Inn",
    "Sunset Suites",
    "Blue Lagoon Resort",
    "City Loft Hotel",
    "Alpine Lodge",
    "Old Mill Hotel",
    "Riverview Inn",
]
BAGS = [
    "suitcase",
    "duffel bag",
    "ski bag",
    "hard case",
    "travel backpack",
    "golf bag",
    "trunk",
    "surfboard bag",
]


def draw_domain(rng, pair):
    ref = "".join(rng.choice("ABCDEFGHJKLMNPQRSTUVWXYZ23456789") for _ in range(6))
    flight = f"{rng.choice(['TK', 'LH', 'BA', 'AF', 'UA', 'QF'])}{rng.randrange(100, 9999)}"
    city, hotel, nights = _pick(rng, CITIES), _pick(rng, HOTELS), rng.randrange(2, 9)
    seat = f"{rng.randrange(3, 40)}{rng.choice('ABCDEF')}"
    covered, weight, limit = pair.yes_no(rng, "travel")
    bag = _pick(rng, BAGS)
    slot = _pick(rng, FLIGHT_SLOTS)
    s = {"date": f"{_pick(rng, MONTHS)} {rng.randrange(1, 29)}", "time": _clock(slot)}
    new_time = _other_time(rng, FLIGHT_SLOTS, slot)

    facts = [
        Round(
            _pick(
                rng,
                [f"I'm flying to {city} on flight {flight}.", f"I have a trip to {city}, flight {flight}."],
            ),
            _pick(
                rng,
                [
                    "Great, I found your booking.",
                    "Thanks, your trip is on my screen.",
                    "Got it, I have your itinerary open.",
                ],
            ),
            {"flight": "Q"},
        ),
        Round(
            _pick(rng, ["What's my booking reference?", "Can I get the reference for this booking?"]),
            _pick(rng, [f"Your booking reference is {ref}.", f"The reference code is {ref}."]),
            {"ref": "A"},
        ),
        Round(
            _pick(rng, ["When does the flight leave?", "What time is departure?", "When do I fly out?"]),
            _pick(
                rng,
                [f"It departs on {s['date']} at {s['time']}.", f"It leaves on {s['date']} at {s['time']}."],
            ),
            {"departure": "A"},
        ),
        Round(
            _pick(
                rng,
                [
                    f"I also booked the {hotel} for {nights} nights.",
                    f"My hotel is the {hotel}, {nights} nights.",
                ],
            ),
            _pick(
                rng,
                [
                    "Noted, I've linked the hotel to your trip.",
                    "Thanks, the hotel is added to your itinerary.",
                ],
            ),
            {"hotel": "Q"},
        ),
        Round(
            _pick(rng, ["Do I have a seat assigned?", "Which seat did I get?"]),
            _pick(rng, [f"You're in seat {seat}.", f"Seat {seat} is assigned to you."]),
            {"seat": "A"},
        ),
        Round(
            _pick(rng, ["How much luggage can I check?", "What's my baggage allowance?"]),
            _pick(
                rng,
                [
                    f"Your fare includes one checked bag of up to {_kg(limit)}.",
                    f"You can check one bag weighing up to {_kg(limit)}.",
                    f"Checked bags on your fare can weigh up to {_kg(limit)}.",
                ],
            ),
            {"bags": "A"},
        ),
    ]
    updates = {
        "departure": Round(
            _pick(rng, ["Any changes to my flight?", "Is my flight still on time?"]),
            _pick(
                rng,
                [
                    f"The airline rescheduled it: it now departs at {new_time}.",
                    f"There's a schedule change; departure is now {new_time}.",
                ],
            ),
            {"departure": "A"},
            apply=lambda st: st.update(time=new_time),
            kind="update",
        )
    }

    def bag_check(st):
        return QueryRound(
            query=_pick(
                rng,
                [
                    f"My {bag} weighs {_kg(weight)}. Can I check it at no extra cost?",
                    f"Will a {_kg(weight)} {bag} be within my baggage allowance?",
                    f"Is {_kg(weight)} okay for my checked {bag} on the flight to {city}?",
                    f"I just weighed my {bag} at {_kg(weight)}. Can it go in the hold for free?",
                ],
            ),
            answer=_pick(
                rng,
                [
                    f"{'Yes' if covered else 'No'}. Your fare to {city} allows up to {_kg(limit)}, so a "
                    f"{_kg(weight)} {bag} {'is within it' if covered else 'is over the limit'}.",
                    f"{'Yes' if covered else 'No'}. At {_kg(weight)}, your {bag} is "
                    f"{'within' if covered else 'over'} the {_kg(limit)} limit of your {city} fare.",
                ],
            ),
            answer_keys=["yes" if covered else "no"],
            analysis=f"whether their {bag} is within the checked-bag weight limit",
            reasoning=f"The fare allows one checked bag of up to {_kg(limit)}; the {bag} weighs "
            f"{_kg(weight)}.",
            derived_yes_no=True,
        )

    about_trip = [
        (f"I've never been to {city} before.", f"{city} is a wonderful place to visit."),
        (f"I'm so excited about this trip to {city}.", "It sounds like a great trip."),
    ]

    def ask_ref(st):
        return QueryRound(
            query=_pick(rng, ["What's my booking reference again?", "Remind me of the reference code?"]),
            answer=f"Your booking reference is {ref}.",
            answer_keys=[ref],
            analysis="for the booking reference",
            reasoning=f"The reference given earlier is {ref}.",
            derived_yes_no=False,
        )

    def ask_departure(st):
        return QueryRound(
            query=_pick(
                rng,
                [
                    "So what time do I leave now?",
                    "What's the current departure time?",
                    "So what time does my flight leave now?",
                    "After all that, when do I take off?",
                    "I'm booking a taxi to the airport. What time does my flight depart?",
                    "Remind me of the departure time as it stands?",
                    "What time is my flight now, with the changes?",
                ],
            ),
            answer=_pick(
                rng,
                [
                    f"You now depart at {st['time']}.",
                    f"Your flight now leaves at {st['time']}.",
                    f"Departure is now at {st['time']}.",
                    f"It departs at {st['time']}.",
                    f"The flight leaves at {st['time']}.",
                ],
            ),
            answer_keys=[st["time"]],
            analysis="for the current departure time",
            reasoning=f"The latest departure time is {st['time']}; it overrides the earlier schedule.",
            derived_yes_no=False,
        )

    def ask_hotel_and_flight(st):
        return QueryRound(
            query=_pick(
                rng,
                ["Which flight am I on and where am I staying?", "Remind me of my flight and my hotel?"],
            ),
            answer=f"You're on flight {flight} and staying at the {hotel} for {nights} nights.",
            answer_keys=[flight, hotel],
            analysis="for their flight and their hotel",
            reasoning=f"The flight is {flight}; the hotel is the {hotel}, {nights} nights.",
            derived_yes_no=False,
        )

    def ask_seat_and_ref(st):
        return QueryRound(
            query=_pick(
                rng,
                [
                    "What seat do I have, and what's the booking reference?",
                    "Give me my seat and reference code, please.",
                ],
            ),
            answer=f"Seat {seat}, booking reference {ref}.",
            answer_keys=[seat, ref],
            analysis="for the seat and the booking reference",
            reasoning=f"The seat is {seat} and the reference is {ref}.",
            derived_yes_no=False,
        )

    queries = [
        QuerySpec(
            "single",
            ["ref"],
            "your booking reference",
            ask_ref,
            [("I always lose track of booking emails.", "Your inbox search usually finds them quickly.")],
        ),
        QuerySpec(
            "update",
            ["departure"],
            "your departure time",
            ask_departure,
            [
                ("I hate rushing to the airport.", "Leaving early makes the airport much calmer."),
                ("My friend is driving me to the airport.", "That's kind of them; it saves you a taxi."),
            ],
        ),
        QuerySpec(
            "pair",
            ["hotel", "flight"],
            "your flight and hotel",
            ask_hotel_and_flight,
            about_trip,
        ),
        QuerySpec(
            "pair",
            ["seat", "ref"],
            "your seat and booking reference",
            ask_seat_and_ref,
            [("I prefer sitting near the front of the plane.", "The front is quicker to get off, too.")],
        ),
        QuerySpec(
            "single",
            ["bags"],
            "the weight limit for your checked bag",
            bag_check,
            [
                ("I always pack far too much for trips.", "Packing light is harder than it sounds."),
                ("My suitcase is already nearly full.", "Packing cubes can help you fit more in."),
                ("I think my bag is heavier than usual this time.", "Bags do get heavy with souvenirs."),
            ],
        ),
    ]
    services = [
        ("Is there Wi-Fi on board?", "Yes, Wi-Fi is available on all our long-haul flights."),
        ("Can I bring a pet?", "Small pets can travel in the cabin for a fee."),
        ("Do you offer travel insurance?", "Yes, you can add travel insurance to any booking."),
        ("How early should I get to the airport?", "We recommend arriving two hours before departure."),
        ("Are meals included?", "Yes, meals are included on flights over three hours."),
        ("Can I choose a window seat?", "Yes, you can pick a seat when you check in online."),
    ]

    def room_total(r):
        place, n, rate = _pick(r, CITIES), r.randrange(2, 10), r.randrange(60, 300, 5)
        total = n * rate
        return _self_contained(
            f"what {n} nights at ${rate} a night cost",
            f"{n} x ${rate} = ${total}.",
            _pick(
                r,
                [
                    f"A room in {place} at ${rate} a night for {n} nights: what does that come to?",
                    f"If I stay {n} nights in {place} at ${rate} per night, what's the total?",
                    f"What do {n} nights in {place} cost at a nightly rate of ${rate}?",
                ],
            ),
            _pick(r, [f"{n} nights at ${rate} come to ${total}.", f"That comes to ${total} for the stay."]),
            [f"${total}"],
        )

    def landing_time(r):
        place, hours, start = _pick(r, CITIES), r.randrange(1, 8), _pick(r, range(6 * 60, 15 * 60, 5))
        begin, end = _clock(start), _clock(start + 60 * hours)
        return _self_contained(
            f"when a {hours}-hour flight that leaves at {begin} lands, in the same time zone",
            f"{begin} plus {hours} hours is {end}.",
            _pick(
                r,
                [
                    f"If a {hours}-hour flight to {place} leaves at {begin}, what time does it land, in "
                    "the same time zone?",
                    f"A flight to {place} takes {hours} hours with no time change. Leaving at {begin}, when "
                    "do I arrive?",
                ],
            ),
            _pick(r, [f"It would land at {end}.", f"Leaving at {begin}, you would arrive at {end}."]),
            [end],
        )

    def extra_bags(r):
        place, n, fee = _pick(r, CITIES), r.randrange(2, 7), r.randrange(20, 100)
        total = n * fee
        return _self_contained(
            f"what {n} extra bags at ${fee} each cost",
            f"{n} x ${fee} = ${total}.",
            _pick(
                r,
                [
                    f"If each extra bag costs ${fee}, what would {n} extra bags to {place} cost me?",
                    f"Say we add {n} extra bags at ${fee} a bag for the {place} trip. What's the total?",
                ],
            ),
            _pick(r, [f"{n} extra bags at ${fee} each come to ${total}.", f"That would be ${total}."]),
            [f"${total}"],
        )

    def group_tickets(r):
        place, n, price = _pick(r, CITIES), r.randrange(2, 9), r.randrange(8, 60)
        total = n * price
        return _self_contained(
            f"what {n} tickets at ${price} each cost",
            f"{n} x ${price} = ${total}.",
            _pick(
                r,
                [
                    f"{n} of us are taking the airport train in {place} at ${price} a ticket. What's the "
                    "total?",
                    f"What do {n} airport shuttle tickets in {place} cost at ${price} each?",
                ],
            ),
            _pick(r, [f"{n} tickets at ${price} each come to ${total}.", f"That's ${total} for all {n}."]),
            [f"${total}"],
        )

    self_contained = [
        SelfContained(
            "the total cost of a hotel stay",
            room_total,
            [("I'm still comparing hotels for the trip.", "It pays to compare a few options.")],
        ),
        SelfContained(
            "what time a flight lands",
            landing_time,
            [("I'm trying to plan what happens after I land.", "A little planning helps on arrival day.")],
        ),
        SelfContained(
            "what extra bags cost",
            extra_bags,
            [("We might bring a lot of gear this time.", "Extra gear can add up quickly.")],
        ),
        SelfContained(
            "the cost of airport train tickets for a group",
            group_tickets,
            [("A few friends are coming along on this trip.", "Travelling in a group is fun.")],
        ),
    ]
    protected = [ref, flight, hotel, seat, s["date"], s["time"], new_time]
    return "travel", s, facts, updates, queries, self_contained, services, protected
