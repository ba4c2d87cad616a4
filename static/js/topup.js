/* Top-up on the billing page with Stripe.js (loaded from the configured STRIPE_JS_URL).
 *
 * 1. Stripe.js tokenizes the card from its card element (card details never reach this server).
 * 2. POST /v1/billing/topups {amount} creates the PaymentIntent.
 * 3. POST /billing/topups/<id>/pay/ {token} saves the card and confirms the PaymentIntent.
 * 4. If the bank asks for 3-D Secure, Stripe.js runs it (confirmCardPayment).
 * 5. The credit arrives with Stripe's signed webhook: poll the balance until it rises.
 */
(function () {
  "use strict";
  const form = document.getElementById("topup-form");
  if (!form || typeof window.Stripe !== "function") return;
  const status = document.getElementById("topup-status");
  const amount = document.getElementById("topup-amount");
  const submit = document.getElementById("topup-submit");
  const balance = document.getElementById("billing-balance");
  const stripe = window.Stripe(form.dataset.publishableKey);
  const card = stripe.elements().create("card", {
    style: { base: { fontSize: "15px", color: "#151a2d", "::placeholder": { color: "#9aa0b4" } } },
  });
  card.mount("#card-element");

  function csrf() {
    const cookie = document.cookie.split("; ").find((c) => c.startsWith("csrftoken="));
    return cookie ? decodeURIComponent(cookie.split("=")[1]) : "";
  }

  function say(text, kind) {
    status.textContent = text;
    status.className = "small " + (kind === "error" ? "error" : kind === "ok" ? "amount-positive" : "muted");
    status.style.color = kind === "error" ? "var(--danger)" : "";
  }

  function busy(on, label) {
    submit.disabled = on;
    submit.querySelector("[data-label]").textContent = label || "Pay";
  }

  async function postJson(url, body) {
    const response = await fetch(url, {
      method: "POST", credentials: "same-origin",
      headers: { "Content-Type": "application/json", "X-CSRFToken": csrf() },
      body: JSON.stringify(body),
    });
    const data = await response.json().catch(() => ({}));
    if (!response.ok) throw new Error((data.error && data.error.message) || "The payment could not be started.");
    return data;
  }

  async function currentBalance() {
    const response = await fetch(form.dataset.balanceUrl, { credentials: "same-origin" });
    if (!response.ok) return null;
    return (await response.json()).balance;
  }

  function toMicros(text) {
    const [whole, frac = ""] = String(text).split(".");
    return BigInt(whole || "0") * 1000000n + BigInt((frac + "000000").slice(0, 6));
  }

  async function waitForCredit(before) {
    for (let i = 0; i < 60; i++) {
      await new Promise((r) => setTimeout(r, 1000));
      const now = await currentBalance();
      if (now !== null && toMicros(now) > toMicros(before)) return now;
    }
    return null;
  }

  // Money stays a decimal string end to end: no Number() (a binary float) ever holds the amount.
  // "25", "25.5", "025.50" → "25.00", "25.50", "25.50"; anything else (a sign, an exponent, more
  // than two decimals) → null.
  const AMOUNT = /^(\d{1,9})(?:\.(\d{0,2}))?$/;

  function normalizedAmount(text) {
    const match = AMOUNT.exec(String(text).trim());
    if (!match) return null;
    const whole = match[1].replace(/^0+(?=\d)/, "");
    return whole + "." + ((match[2] || "") + "00").slice(0, 2);
  }

  form.querySelectorAll("[data-amount]").forEach((button) => {
    button.addEventListener("click", () => {
      amount.value = button.dataset.amount;
      form.querySelectorAll("[data-amount]").forEach((b) => b.classList.toggle("active", b === button));
    });
  });
  amount.addEventListener("input", () => {
    const typed = normalizedAmount(amount.value);
    form.querySelectorAll("[data-amount]").forEach((b) => b.classList.toggle("active", b.dataset.amount === typed));
  });

  form.addEventListener("submit", async (event) => {
    event.preventDefault();
    const value = normalizedAmount(amount.value);
    if (value === null) {
      say("Enter the amount in dollars and cents, such as 25 or 25.50.", "error");
      return;
    }
    if (toMicros(value) < toMicros(amount.min) || toMicros(value) > toMicros(amount.max)) {
      const dollars = (text) => Number(text).toLocaleString("en-US", { style: "currency", currency: "USD" });
      say(`Choose an amount between ${dollars(amount.min)} and ${dollars(amount.max)}.`, "error");
      return;
    }
    busy(true, "Processing…");
    say("Checking your card…");
    try {
      const before = balance.dataset.balance;
      const tokenResult = await stripe.createToken(card);
      if (tokenResult.error) throw new Error(tokenResult.error.message || "Check the card details.");
      const intent = await postJson(form.dataset.topupsUrl, { amount: value });
      say("Charging your card…");
      let payment = await postJson(form.dataset.payUrl.replace("PAYMENT_INTENT", encodeURIComponent(intent.id)),
                                   { token: tokenResult.token.id });
      if (payment.status === "requires_action") {
        say("Your bank asks you to confirm the payment…");
        const confirmation = await stripe.confirmCardPayment(payment.client_secret);
        if (confirmation.error) throw new Error(confirmation.error.message || "The payment was not confirmed.");
      } else if (payment.status === "requires_payment_method") {
        throw new Error("Your card was declined. Try another card.");
      }
      say("Payment accepted. Adding the credit…");
      const after = await waitForCredit(before);
      if (after === null) {
        say("Payment accepted. The credit appears here as soon as Stripe confirms it.", "ok");
      } else {
        balance.textContent = "$" + after.replace(/(\.\d\d\d*?)0+$/, "$1");
        balance.dataset.balance = after;
        say(`Done: $${value} added to your credit.`, "ok");
        setTimeout(() => window.location.reload(), 1200);
      }
      busy(false);
    } catch (error) {
      say(error.message, "error");
      busy(false);
    }
  });
})();
