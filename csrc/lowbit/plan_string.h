// Plan strings: how a caller forces a kernel choice for one call (tests and
// probes, through the private ops lowbit::_nvfp4_linear_with_plan and
// lowbit::_nvfp4_moe_with_plan). A plan string is "key=value" items separated
// by commas, spaces around items, keys and values ignored; "" leaves every
// choice to the shipped plan. Each family parses its own keys
// (parse_linear_plan_string in linear/sm90_linear_plan.h,
// parse_moe_plan_string in moe/nvfp4_moe.h) with these helpers; a malformed
// item, an unknown key, a key given twice or a bad value throws
// std::invalid_argument naming the key (the bindings raise it as ValueError).
// Host code only.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <stdexcept>
#include <string>
#include <vector>

namespace lowbit::plan_string {

struct Item {
  std::string key, value;
};

[[noreturn]] inline void fail(const std::string& spec, const std::string& what) {
  throw std::invalid_argument("plan \"" + spec + "\": " + what);
}

inline std::string trimmed(const std::string& s) {
  const size_t b = s.find_first_not_of(" \t"), e = s.find_last_not_of(" \t");
  return b == std::string::npos ? std::string() : s.substr(b, e - b + 1);
}

// The items of `spec` in order.
inline std::vector<Item> split(const std::string& spec) {
  std::vector<Item> items;
  if (trimmed(spec).empty()) return items;
  size_t start = 0;
  while (true) {
    const size_t comma = spec.find(',', start);
    const size_t length = comma == std::string::npos ? std::string::npos : comma - start;
    const std::string item = trimmed(spec.substr(start, length));
    const size_t eq = item.find('=');
    if (eq == std::string::npos || trimmed(item.substr(0, eq)).empty())
      fail(spec, "item \"" + item + "\" is not key=value");
    Item it{trimmed(item.substr(0, eq)), trimmed(item.substr(eq + 1))};
    for (const Item& seen : items)
      if (seen.key == it.key) fail(spec, "key \"" + it.key + "\" given twice");
    items.push_back(std::move(it));
    if (comma == std::string::npos) break;
    start = comma + 1;
  }
  return items;
}

[[noreturn]] inline void unknown_key(const std::string& spec, const Item& it, const char* keys) {
  fail(spec, "unknown key \"" + it.key + "\" (keys: " + keys + ")");
}

[[noreturn]] inline void bad_value(const std::string& spec, const Item& it, const std::string& expected) {
  fail(spec, "key \"" + it.key + "\" takes " + expected + ", got \"" + it.value + "\"");
}

// The value as a decimal integer in [lo, hi], else bad_value.
inline int64_t integer(const std::string& spec, const Item& it, int64_t lo, int64_t hi, const std::string& expected) {
  const std::string& v = it.value;
  bool digits = !v.empty() && v.size() <= 18;
  for (char c : v) digits = digits && c >= '0' && c <= '9';
  if (!digits) bad_value(spec, it, expected);
  const int64_t x = std::stoll(v);
  if (x < lo || x > hi) bad_value(spec, it, expected);
  return x;
}

// The value if it is one of `allowed`, else bad_value.
inline int one_of(const std::string& spec, const Item& it, std::initializer_list<int> allowed) {
  std::string expected;
  size_t i = 0;
  for (int a : allowed) expected += (i++ == 0 ? "" : i == allowed.size() ? " or " : ", ") + std::to_string(a);
  const int64_t x = integer(spec, it, INT32_MIN, INT32_MAX, expected);
  for (int a : allowed)
    if (x == a) return a;
  bad_value(spec, it, expected);
}

inline bool flag(const std::string& spec, const Item& it) { return one_of(spec, it, {0, 1}) == 1; }

}  // namespace lowbit::plan_string
